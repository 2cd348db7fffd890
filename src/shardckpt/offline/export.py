"""``export``: the model weights of any checkpoint ``open_reader`` reads, written as Hugging Face style
safetensors, streamed: memory holds one slice buffer (and one for the cast), whatever the model's size.

**What is exported.** By default the model weights only:

- a training checkpoint's ``model`` entry (``{"model": {...}, "optim": {...}, ...}``), named relative to it
  (``model.layer.weight`` -> ``layer.weight``);
- a checkpoint without a ``model`` entry (a plain state dict, a safetensors directory, ...): every tensor
  except those under a top-level ``optim`` or ``optimizer`` entry.

``only`` (dotted-name prefixes, ``checkpoint.load_any.wanted_keys``) picks other entries instead; their
names are then the full dotted names. ``strip_prefix`` is removed from the front of every name that has it,
and then the wrapper prefixes ``module.`` (DDP, leading only) and ``_orig_mod.`` (``torch.compile``, as a
leading prefix or a name component anywhere) are removed. A selection that keeps no tensor raises
``NoModelWeightsError``, listing the top-level entries that hold tensors (what ``only`` could pick).

``rename`` (``--rename-map FILE``, a JSON object) maps regular expressions to replacements, applied last:
each name is renamed by the first rule whose pattern matches the whole name (``re.fullmatch``; ``\\1``,
``\\g<name>`` refer to its groups), and a rule whose replacement is ``null`` leaves the tensor out. Names no
rule matches are kept as they are. A rule that matches no tensor is an error (a typo would otherwise
export silently under the old names), as are two tensors renamed to one name.

A LOCAL shardckpt checkpoint is read through ``formats.local_view.logical_view``, so its parameters appear by
name, padding never shows. **Tied weights** are written once, under the first name (the one
``named_parameters()`` keeps), as transformers expects: it re-ties the others on load. Tied means: the
logical view presents the names as aliases of one member (LOCAL), or the checkpoint's tree refers to one
stored tensor under two names. Other formats store tied weights as separate tensors (a FULL or SHARDED
shardckpt checkpoint, DCP, ``torch.save`` after loading): whether two of them shared storage in the job is
not knowable from the files, and both are written.

**Output** (the huggingface_hub convention): ``model.safetensors`` when all tensors fit in one shard of
``max_shard_size`` bytes (tensor bytes; headers not counted), else ``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``). The
number of shards is the fewest the limit allows (tensors kept in source order, never split), and the shards
are balanced: a tensor goes to the shard its middle byte falls in when the bytes are cut into that many
equal parts (``plan_shards``). A tensor larger than the limit gets a shard of its own. Every file's
``__metadata__`` is ``{"format": "pt", "export_id": ...}`` (and ``"adapter"`` with one): nothing of the source's
path or save, so two exports of equal weights write equal files. ``export_id`` (also in the index's
``metadata``) digests the files' headers and the source's content (``resume.content_identity``: a shardckpt
checkpoint's tensor checksums, tree and metadata), so that a reader refuses a file of another export beside the
index (``formats.safetensors``: two exports to one object-store path); readers do not present it as a value.
Only an export of a source without checksums (another format) to an object store gets a random one: there two
such exports of different weights could otherwise mix unnoticed; on local disk the commit's renames under a
lock leave no mix, and its id is the headers' digest.

**Model directory** (``config``): the config and tokenizer files beside the weights (``offline.hf_dir``), checked
before anything is written, committed before the index (or the one file); ``overwrite`` replaces them, and
without ``config`` removes those an old export there had (a config.json naming another dtype, its tokenizer).

**Streaming.** A file's header is computed from shapes and dtypes before any data is read (JSON, padded with
spaces to a multiple of 8 bytes, as safetensors writes it); then the 8-byte header length, the header, and
each tensor's bytes in order, read from the source in slices of at most ``slice_bytes`` (64 MiB) as
``ReadRequest``s of flat ranges into one reused buffer, cast into a second one. What a reader holds to fill a
slice is its own: shardckpt's reader reads the slice widened to whole checksum blocks; the torch DCP reader,
when it verifies (``verify=True``, the default), reads and checks a whole DCP chunk (one rank's piece of the
tensor) for every slice of it, so memory then holds one chunk and a chunk larger than a slice is read once
per slice; ``verify=False`` reads DCP's raw chunks by the slice, unchecked.

**Commit** (``export_commit``). On local disk every file, the index too, is written in a directory of the
export's own (``.export-tmp-<token>/``, held until it ends); only once the last one is whole are they renamed
into place, under a lock on the destination, the old export's files moved aside first and removed last, the
index (or the one file) renamed last. A directory of shards without their index is refused by every reader,
so a killed export is never taken for a whole one; a failure renames everything back (the old export stays
whole). On object stores each file is written at its name (an object appears only when its upload
completes), the old files removed before, the index last (so there a source in ``dst`` is refused with
``overwrite``: it would be removed before it is read). An export already at ``dst`` (``model.safetensors``,
the index) raises ``CheckpointExistsError`` unless ``overwrite``, as does one committed there by another
export meanwhile. A failure removes what this export wrote, but on object stores the files of a shardckpt
source, which a second run of the same export may have taken as its own (a rerun resumes them; without their
index no reader takes them for an export): see ``export_commit``.

**Resume.** A killed export leaves its finished files (in its directory on local disk, each named only once
durable). Run again with the same source and options, it keeps every file whose size and header are exactly
what it would write, and writes the rest: the header's ``export_id`` digests the source's content (its tensors'
CRC32Cs), so a source saved since with other values is never mixed in. Sources of other formats have no
checksums: their unfinished exports are not resumed. What a killed export left
is removed by the next export and by ``shardckpt gc`` (then nothing is resumed). On object stores, an
unfinished export of another source or with other options raises ``CheckpointExistsError`` unless
``overwrite``. The byte-I/O protocol has no rename, delete or abort of one file yet:
``offline.safetensors_files`` does them (``rename``, ``remove``, ``abandon``) until it has, and writes the
files.

**dtype**: ``"keep"`` or one of bfloat16 / float16 / float32 (names or torch dtypes): floating-point tensors
are cast, integer and bool tensors kept.
"""
from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from shardckpt.checkpoint.load_any import wanted_keys
from shardckpt.offline import adapters, hf_dir, safetensors_files
from shardckpt.offline.export_commit import (
    Beside, PlannedFile, commit_local, export_id, index_bytes, refuse_own_source, write_remote,
)
from shardckpt.offline.memory import buffer_budget
from shardckpt.offline.rename import Renames
from shardckpt.offline.safetensors_files import SHARD_FILE, SINGLE_FILE, existing_export, header_bytes
from shardckpt.offline.resume import content_identity
from shardckpt.errors import CheckpointExistsError, IncompatibleCheckpointError, UnsupportedValueError
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader
from shardckpt.formats.detect import open_reader
from shardckpt.formats.safetensors_header import DTYPE_NAMES, EXPORT_ID_KEY, INDEX_NAME, METADATA_KEY
from shardckpt.io import LocalStorage, open_storage
from shardckpt.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from shardckpt.formats.local_view import LogicalView, logical_view

SLICE_BYTES = 64 << 20  # bytes per read from the source at most: the memory an export holds (twice, with a cast)
MIN_SLICE_BYTES = 1 << 20  # the slices of a memory limit below what the process holds already
WRAPPERS = ("module.", "_orig_mod.")
OPTIMIZER_ENTRIES = ("optim", "optimizer")
CASTS: dict[str, torch.dtype | None] = {
    "keep": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
    "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
    "float": torch.float32,
}


class NoModelWeightsError(IncompatibleCheckpointError):
    """The selection (the model weights by default, or ``only``) keeps no tensor of the source."""


@dataclass(frozen=True)
class ExportReport:
    files: tuple[str, ...]  # the data files written, in order
    tensors: int
    total_size: int  # tensor bytes written, as the index's metadata.total_size says
    dtype: str  # "keep" or the cast's name
    tied: dict[str, str] = field(default_factory=dict)  # a name left out -> the name written for it
    kept: tuple[str, ...] = ()  # files a killed export of the same source and plan had finished, not rewritten


@dataclass(frozen=True)
class _Tensor:
    """One output tensor: its output name, the source tensor it is read from, the dtypes and shape."""

    name: str
    source: str
    source_dtype: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def export(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str | torch.dtype = "keep",
           max_shard_size: int | str | None = None, only: Sequence[str] | None = None,
           strip_prefix: str | None = None, overwrite: bool = False, storage_options: dict | None = None,
           dst_storage_options: dict | None = None, progress: Callable[[int, int], None] | None = None,
           slice_bytes: int = SLICE_BYTES, verify: bool = True,
           rename: Mapping[str, str | None] | None = None, adapter: str | None = None,
           reverse: bool = False, config: str | os.PathLike | None = None) -> ExportReport:
    """Export the model weights of ``src`` (any readable checkpoint) as safetensors files in directory ``dst``.

    See the module's docstring for what is selected, how names are formed, the files and the commit.
    ``max_shard_size``: bytes (an int, or a string such as ``"5GB"``, ``"500MiB"``). ``storage_options`` /
    ``dst_storage_options``: fsspec options of the source / destination. ``progress(done_bytes, total_bytes)``
    is called as tensor bytes are written. ``slice_bytes``: the most bytes one read from the source fills.
    ``verify``: check the checksums the source stores (see the module's docstring for its cost on DCP).
    ``rename``: regular expression -> replacement (None: leave out), see the module's docstring.
    ``config``: a ``config.json`` or a model directory: write a complete model directory (``offline.hf_dir``:
    the config and tokenizer files, consistent with the weights and checked against them first);
    ``max_shard_size`` None: the installed transformers' ``save_pretrained`` default with ``config``, else 5GB.
    ``adapter``: a model family's names and layouts to HF's (``"torchtitan-llama:n_heads=32,n_kv_heads=8"``;
    ``offline.adapters``), from HF's when ``reverse``; applied to the model weights before the selection.
    Nothing is read before the selection, dtypes and sizes are checked; nothing is written before the
    destination is checked.
    """
    cast = cast_dtype(dtype)
    if max_shard_size is None:
        max_shard_size = DEFAULT_MAX_SHARD_SIZE if config is None else hf_dir.default_max_shard_size()
    limit = parse_size(max_shard_size)
    if not isinstance(slice_bytes, int) or slice_bytes < 1:
        raise ValueError(f"slice_bytes must be a positive int, got {slice_bytes!r}")
    base = open_reader(src, storage_options=storage_options, verify=verify)
    reference = None if config is None else hf_dir.read_reference(config)
    reader = adapters.apply(logical_view(base), adapter, reverse, None if reference is None else reference.config)
    tensors, tied = select(reader, only, strip_prefix, cast, Renames(rename or {}))
    directory = None
    if reference is not None:
        directory = hf_dir.plan_directory(reference, tensors, tied, reader, slice_bytes)
        tensors = [t for t in tensors if t.name not in directory.left_out]
        tied = {**tied, **directory.left_out}
    shards = plan_shards([t.nbytes for t in tensors], limit)
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [SHARD_FILE.format(index=i + 1, count=len(shards)) for i in range(len(shards))]
    metadata = {"format": "pt"}  # nothing of the source's path or save: equal weights, equal files
    identity = content_identity(base)
    if adapter is not None:  # the same names and shapes, other bytes: a resume must not keep the other's files
        metadata["adapter"] = f"{adapter} (reverse)" if reverse else str(adapter)
    planned = [(name, [tensors[i] for i in shard]) for name, shard in zip(names, shards)]
    headers = [header_bytes(members, metadata) for _, members in planned]
    storage = open_storage(dst, dst_storage_options)
    local = isinstance(storage, LocalStorage)  # committed by renames under a lock: no other export's file mixes in
    metadata[EXPORT_ID_KEY] = export_id(headers, identity if identity is not None or not local else "")
    files = [PlannedFile(name, header_bytes(members, metadata), members) for name, members in planned]
    total = sum(t.nbytes for t in tensors)
    old = existing_export(storage)
    if not overwrite and (INDEX_NAME in old or SINGLE_FILE in old):
        raise CheckpointExistsError(f"{storage.url(old[0])}: an export already exists at {storage.root} "
                                    f"({len(old)} files); pass overwrite=True to replace it")
    extras = {} if directory is None else directory.files
    # Replaced or removed: an overwrite leaves none of the old export's directory files beside other weights.
    beside = [n for n in hf_dir.OUTPUT_FILES if (extras or (overwrite and old)) and storage.exists(n)]
    if beside and not overwrite:
        raise CheckpointExistsError(f"{storage.url(beside[0])}: already exists at {storage.root}; pass "
                                    "overwrite=True to replace it")
    if overwrite and old and not local:
        refuse_own_source(storage, open_storage(src, storage_options), os.fspath(src))
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    buffers = safetensors_files.Buffers(tensors, slice_bytes)

    def write(storage, path: str, f: PlannedFile):
        return safetensors_files.write_file(storage, path, f.header, f.members, reader, buffers, tick)

    counted = {} if directory is None or directory.total_parameters is None else \
        {"total_parameters": directory.total_parameters}
    index = index_bytes(files, total, metadata[EXPORT_ID_KEY], counted)
    args = (storage, files, index, old, overwrite, identity is not None, write, lambda f: tick(f.nbytes),
            Beside(extras, beside))
    kept = commit_local(*args, uuid.uuid4().hex[:12]) if local else write_remote(*args)
    return ExportReport(tuple(names), len(tensors), total, "keep" if cast is None else _dtype_name(cast), tied, kept)


# ---------------------------------------------------------------------------------------------------------
# Options


def cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype floating-point tensors are cast to (None: keep), from a name (``CASTS``) or a torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in set(v for v in CASTS.values() if v is not None):
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.").lower() in CASTS:
        return CASTS[dtype.removeprefix("torch.").lower()]
    raise ValueError(f"dtype {dtype!r}: expected one of keep, bfloat16, float16, float32 (or bf16, fp16, fp32)")


def slice_bytes_for(memory_limit: int) -> int:
    """The ``slice_bytes`` that keeps this process's resident memory within ``memory_limit`` (``offline.memory``):
    export's two buffers (a slice as read, and as cast) share what the process does not hold yet; 1 MiB slices
    when it already holds the limit."""
    budget = buffer_budget(memory_limit, "export")
    return max(1, budget // 2) if budget else MIN_SLICE_BYTES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------
# Selection (pure over the reader's tree and tensor list)


def select(reader: CheckpointReader, only: Sequence[str] | None, strip_prefix: str | None,
           cast: torch.dtype | None, rename: Renames | None = None) -> tuple[list[_Tensor], dict[str, str]]:
    """The output tensors in source order, and the tied names left out (see the module's docstring)."""
    tree = reader.tree()
    refs = [(path, leaf) for path, leaf in leaves(tree, lambda v: isinstance(v, TensorRef))
            if isinstance(leaf, TensorRef)]
    if only is not None:
        if isinstance(only, str):
            only = [only]
        keep = wanted_keys(only)
        chosen = [(path_name(p), leaf) for p, leaf in refs if keep(path_name(p))]
        what = f"only={list(only)} selects no tensor"
    elif isinstance(tree, dict) and isinstance(tree.get("model"), dict):
        chosen = [(path_name(p[1:]), leaf) for p, leaf in refs if p and p[0] == "model"]
        what = "its 'model' entry holds no tensor"
    else:
        chosen = [(path_name(p), leaf) for p, leaf in refs if not (p and p[0] in OPTIMIZER_ENTRIES)]
        what = "it holds no model weights (no 'model' entry, and no tensor outside its optimizer state)"
    if not chosen:
        raise NoModelWeightsError(f"nothing to export: {what}. {_what_only_could_pick(refs)}")
    infos = reader.tensors()
    out: list[_Tensor] = []
    first_of: dict[Any, str] = {}  # a stored source -> the output name written for it
    by_name: dict[str, str] = {}  # output name -> the source name it came from
    tied: dict[str, str] = {}
    for name, ref in chosen:
        name = strip_wrappers(name.removeprefix(strip_prefix) if strip_prefix else name)
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        key = _storage_key(reader, ref.name)
        if key in first_of:
            tied[name] = first_of[key]
            continue
        if not name or name == METADATA_KEY:
            raise UnsupportedValueError(f"tensor {ref.name!r} would be named {name!r} in the export, which "
                                        "safetensors cannot hold")
        if name in by_name:
            raise IncompatibleCheckpointError(f"tensors {by_name[name]!r} and {ref.name!r} both become {name!r} "
                                              "in the export (after removing prefixes); pick one with only=")
        info = infos[ref.name]
        dtype = cast if cast is not None and info.dtype.is_floating_point else info.dtype
        if dtype not in DTYPE_NAMES:
            raise UnsupportedValueError(f"tensor {ref.name!r} is {info.dtype}, which safetensors has no dtype for")
        first_of[key], by_name[name] = name, ref.name
        out.append(_Tensor(name, ref.name, info.dtype, dtype, tuple(info.shape)))
    if rename is not None:
        rename.check_all_used()
    if not out:
        raise NoModelWeightsError("nothing to export: the rename rules leave every tensor out")
    return out, tied


def strip_wrappers(name: str) -> str:
    """``name`` without leading ``module.`` / ``_orig_mod.`` prefixes and ``_orig_mod`` components."""
    while name.startswith(WRAPPERS):
        name = name[len(next(w for w in WRAPPERS if name.startswith(w))):]
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _storage_key(reader: CheckpointReader, name: str) -> Any:
    """What identifies the stored bytes of tensor ``name``: two names with one key are tied."""
    return reader.source(name) if isinstance(reader, LogicalView) else name


def _what_only_could_pick(refs: list[tuple[tuple, TensorRef]]) -> str:
    counts: dict[str, int] = {}
    for path, _ in refs:
        top = str(path[0]) if path else "(the root)"
        counts[top] = counts.get(top, 0) + 1
    if not counts:
        return "The source holds no tensors at all."
    shown = ", ".join(f"{k} ({n} tensor{'s' if n > 1 else ''})" for k, n in list(counts.items())[:20])
    more = f" and {len(counts) - 20} more" if len(counts) > 20 else ""
    return f"Top-level entries holding tensors, which only= can pick: {shown}{more}"


# ---------------------------------------------------------------------------------------------------------
# Sharding and headers (pure)


def _greedy(indices: Sequence[int], sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Contiguous packing: a new shard when the next tensor would take this one over ``cap``."""
    shards: list[list[int]] = []
    used = 0
    for i in indices:
        if not shards or used + sizes[i] > cap:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += sizes[i]
    return shards


def _balanced(indices: Sequence[int], sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Tensors none of which exceeds ``limit``, in the fewest contiguous shards of at most ``limit`` bytes
    (greedy packing finds that count), balanced: each tensor goes to the shard its middle byte falls in
    when the bytes are cut into equal parts; where that overfills a shard, greedy packing with the smallest
    cap that keeps the count."""
    count = len(_greedy(indices, sizes, limit))
    total = sum(sizes[i] for i in indices)
    if count <= 1:
        return [list(indices)]
    parts: list[list[int]] = [[] for _ in range(count)]
    start = 0
    for i in indices:
        parts[min(count - 1, (2 * start + sizes[i]) * count // (2 * total))].append(i)
        start += sizes[i]
    parts = [p for p in parts if p]
    if all(sum(sizes[i] for i in p) <= limit for p in parts):
        return parts
    lo, hi = max(sizes[i] for i in indices), limit
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(indices, sizes, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    return _greedy(indices, sizes, hi)


def plan_shards(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Tensor indices per shard, in order: a tensor over ``limit`` bytes alone; the runs of tensors between
    such ones in the fewest shards of at most ``limit`` bytes, balanced (``_balanced``)."""
    shards: list[list[int]] = []
    run: list[int] = []
    for i, size in enumerate(sizes):
        if size > limit:
            if run:
                shards += _balanced(run, sizes, limit)
            shards.append([i])
            run = []
        else:
            run.append(i)
    if run:
        shards += _balanced(run, sizes, limit)
    return shards
