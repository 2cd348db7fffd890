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

**Streaming**, through the one write pipeline (``checkpoint.persist``; the commit protocols below are the
safetensors format's writers behind its seam). The files are planned first (``offline.export_plan``). A file's
header is computed from shapes and dtypes before any data is read (JSON, padded with spaces to a multiple of 8
bytes, as safetensors writes it); then the 8-byte header length, the header, and each tensor's bytes in order,
streamed from the source as ``convert`` streams its chunks (``offline.streams``): slices read as ``ReadRequest``s
of flat ranges into one reused slice buffer (``offline.memory.SliceBuffers``: 128 MiB by default, else what
``memory_limit`` leaves), cast into the same buffer's other part. What a reader holds to fill a
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

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from shardckpt.checkpoint.persist import OutputWriter, persist
from shardckpt.checkpoint.progress import Progress
from shardckpt.errors import CheckpointExistsError
from shardckpt.formats.detect import open_reader
from shardckpt.formats.safetensors_header import EXPORT_ID_KEY, INDEX_NAME
from shardckpt.io import LocalStorage, Storage, open_storage, where
from shardckpt.offline import adapters, hf_dir, safetensors_files
from shardckpt.offline.export_commit import (
    Beside, ExportFiles, LocalExport, PlannedFile, RemoteExport, export_id, index_bytes, refuse_own_source,
)
from shardckpt.offline.export_plan import ExportPlan, plan_export
from shardckpt.offline.memory import ALIGN, OVER_LIMIT_BUFFER_BYTES, SliceBuffers, buffer_budget, writer_reserve
from shardckpt.offline.resume import content_identity
from shardckpt.offline.safetensors_files import SINGLE_FILE, existing_export
from shardckpt.offline.spec import ExportSpec
from shardckpt.offline.streams import ReadOnDemand, largest_slice
from shardckpt.formats.local_view import logical_view

__all__ = ["export", "run", "ExportReport", "INDEX_NAME", "SINGLE_FILE"]

SLICE_BYTES = 64 << 20  # what a tie check or a comparison reads at once, per side
BUFFER_BYTES = 2 * SLICE_BYTES  # the slice buffer without a memory limit (a slice as read and as cast)


@dataclass(frozen=True)
class ExportReport:
    files: tuple[str, ...]  # the data files written, in order
    tensors: int
    total_size: int  # tensor bytes written, as the index's metadata.total_size says
    dtype: str  # "keep" or the cast's name
    tied: dict[str, str] = field(default_factory=dict)  # a name left out -> the name written for it
    kept: tuple[str, ...] = ()  # files a killed export of the same source and plan had finished, not rewritten


def export(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None,
           slice_bytes: int | None = None, **options: Any) -> ExportReport:
    """Export the model weights of ``src`` (any readable checkpoint) as safetensors files in directory ``dst``:
    ``run`` of ``ExportSpec(src, dst, **options)`` (its fields are the options; ``offline.spec``)."""
    return run(ExportSpec(src, dst, **options), progress, slice_bytes)


def run(spec: ExportSpec, progress: Callable[[int, int], None] | None = None,
        slice_bytes: int | None = None) -> ExportReport:
    """The export ``spec`` asks for (``spec.latest`` is the caller's: ``src`` is the checkpoint itself here).

    See the module's docstring for what is selected, how names are formed, the files and the commit.
    ``progress(done_bytes, total_bytes)`` is called as tensor bytes are written. ``slice_bytes``: the most bytes
    one read from the source fills (default: half of what ``spec.memory_limit`` leaves the slice buffer, else
    half of ``BUFFER_BYTES``: the other half holds the slice as cast). Nothing is read before the
    selection, dtypes and sizes are checked; nothing is written before the destination is checked."""
    if slice_bytes is not None and (not isinstance(slice_bytes, int) or slice_bytes < 1):
        raise ValueError(f"slice_bytes must be a positive int, got {slice_bytes!r}")
    base = open_reader(spec.src, storage_options=spec.storage_options, verify=spec.verify)
    reference = None if spec.config is None else hf_dir.read_reference(spec.config)
    reader = adapters.apply(logical_view(base), spec.adapter, spec.reverse,
                            None if reference is None else reference.config)
    storage = open_storage(spec.dst, spec.dst_storage_options)
    budget = (buffer_bytes(spec.memory_limit, writer_reserve(storage, 1)) if slice_bytes is None
              else 2 * slice_bytes + ALIGN)
    slice_bytes = slice_bytes or budget // 2  # half the buffer as read, half as cast
    plan = plan_export(reader, spec, reference, slice_bytes)
    planned = _planned_files(plan, storage, spec, content_identity(base))
    tick = Progress(sum(t.nbytes for t in plan.tensors), progress)
    buffers = SliceBuffers.within(budget, 1, largest_slice(plan.tensors))
    pieces = ReadOnDemand(reader, {t.name: t for t in plan.tensors}, None, tick, buffers, slice_bytes)

    def write(storage: Storage, path: str, f: PlannedFile) -> None:
        safetensors_files.write_file(storage, path, f.header, f.members, pieces)

    skip = lambda f: tick(f.nbytes)  # noqa: E731 - a file a killed run finished counts as written
    writer: OutputWriter = LocalExport(storage, planned, write, skip, uuid.uuid4().hex[:12]) \
        if isinstance(storage, LocalStorage) else RemoteExport(storage, planned, write, skip)
    persist(writer)
    return ExportReport(tuple(name for name, _ in plan.files), len(plan.tensors), sum(t.nbytes for t in plan.tensors),
                        spec.dtype, plan.tied, writer.kept)


def _planned_files(plan: ExportPlan, storage: Storage, spec: ExportSpec, identity: str | None) -> ExportFiles:
    """The files with their headers and the index, named by the ``export_id``, and what is at ``storage`` now,
    checked: an export there (or its directory files) is replaced only with ``overwrite``."""
    local = isinstance(storage, LocalStorage)  # committed by renames under a lock: no other export's file mixes in
    ident = export_id(plan.headers, identity if identity is not None or not local else "")
    metadata = {**plan.metadata, EXPORT_ID_KEY: ident}
    files = [PlannedFile(name, safetensors_files.header_bytes(members, metadata), members)
             for name, members in plan.files]
    counted = {} if plan.total_parameters is None else {"total_parameters": plan.total_parameters}
    index = index_bytes(files, sum(t.nbytes for t in plan.tensors), ident, counted)
    old = existing_export(storage)
    if not spec.overwrite and (INDEX_NAME in old or SINGLE_FILE in old):
        raise CheckpointExistsError(f"{storage.url(old[0])}: an export already exists at {storage.root} "
                                    f"({len(old)} files); pass overwrite=True to replace it")
    # Replaced or removed: an overwrite leaves none of the old export's directory files beside other weights.
    beside = [n for n in hf_dir.OUTPUT_FILES if (plan.beside or (spec.overwrite and old)) and storage.exists(n)]
    if beside and not spec.overwrite:
        raise CheckpointExistsError(f"{storage.url(beside[0])}: already exists at {storage.root}; pass "
                                    "overwrite=True to replace it")
    if spec.overwrite and old and not local:
        refuse_own_source(storage, open_storage(spec.src, spec.storage_options), where(spec.src))
    return ExportFiles(files, index, Beside(plan.beside, beside), old, spec.overwrite, identity is not None)


def buffer_bytes(memory_limit: int | None, reserve: int = 0) -> int:
    """The slice buffer that keeps this process's resident memory within ``memory_limit`` (``offline.memory``):
    a slice as read and as cast share what the process does not hold yet, less ``reserve`` (the file writer's own
    buffer); 1 MiB when it already holds the limit."""
    return buffer_budget(memory_limit, "export", reserve, default=BUFFER_BYTES) or OVER_LIMIT_BUFFER_BYTES
