"""What an export writes, decided before anything is: the output tensors (``select``: the model weights, or ``only``,
renamed and cast), the tied names left out, the model directory's files (``offline.hf_dir``), and the files the
tensors go in (``plan_shards``). ``plan_export`` puts them together; ``offline.export`` writes them. Nothing here
writes, and nothing reads a value but the check of tied weights a ``config`` asks for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardckpt.checkpoint.load_any import wanted_keys
from shardckpt.errors import IncompatibleCheckpointError, UnsupportedValueError
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader
from shardckpt.formats.safetensors_header import DTYPE_NAMES, METADATA_KEY
from shardckpt.offline import hf_dir
from shardckpt.offline.adapters.reader import strip_wrappers
from shardckpt.offline.rename import Renames
from shardckpt.offline.safetensors_files import SHARD_FILE, SINGLE_FILE, header_bytes
from shardckpt.offline.spec import ExportSpec
from shardckpt.offline.streams import Output
from shardckpt.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from shardckpt.formats.local_view import LogicalView

OPTIMIZER_ENTRIES = ("optim", "optimizer")


class NoModelWeightsError(IncompatibleCheckpointError):
    """The selection (the model weights by default, or ``only``) keeps no tensor of the source."""


@dataclass(frozen=True)
class ExportPlan:
    """The files of an export: each name with its tensors, in order, and its header but for the ``export_id``
    (which digests the headers: ``offline.export_commit.export_id``); the tied names left out; the model
    directory's files (``config``: name -> bytes) and its parameter count."""

    files: list[tuple[str, list[Output]]]
    metadata: dict[str, str]  # every file's __metadata__, but the export_id
    tied: dict[str, str]
    beside: dict[str, bytes]
    total_parameters: int | None

    @property
    def tensors(self) -> list[Output]:
        return [t for _, members in self.files for t in members]

    @property
    def headers(self) -> list[bytes]:
        return [header_bytes(members, self.metadata) for _, members in self.files]


def plan_export(reader: CheckpointReader, spec: ExportSpec, reference: hf_dir.Reference | None,
                slice_bytes: int) -> ExportPlan:
    """The export of ``reader`` (the source as exported: an adapter applied) that ``spec`` asks for; ``reference``:
    ``spec.config`` read (``hf_dir.read_reference``); ``slice_bytes``: what the tie check reads at once."""
    cast = None if spec.dtype == "keep" else getattr(torch, spec.dtype)
    tensors, tied = select(reader, spec.only, spec.strip_prefix, cast, Renames(spec.rename_map or {}))
    beside, total_parameters = {}, None
    if reference is not None:
        directory = hf_dir.plan_directory(reference, tensors, tied, reader, slice_bytes)
        tensors = [t for t in tensors if t.name not in directory.left_out]
        tied = {**tied, **directory.left_out}
        beside, total_parameters = directory.files, directory.total_parameters
    limit = spec.max_shard_size or parse_size(DEFAULT_MAX_SHARD_SIZE if reference is None else
                                              hf_dir.default_max_shard_size())
    shards = plan_shards([t.nbytes for t in tensors], limit)
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [SHARD_FILE.format(index=i + 1, count=len(shards)) for i in range(len(shards))]
    metadata = {"format": "pt"}  # nothing of the source's path or save: equal weights, equal files
    if spec.adapter is not None:  # the same names and shapes, other bytes: a resume must not keep the other's files
        metadata["adapter"] = f"{spec.adapter} (reverse)" if spec.reverse else spec.adapter
    files = [(name, [tensors[i] for i in shard]) for name, shard in zip(names, shards)]
    return ExportPlan(files, metadata, tied, beside, total_parameters)


def select(reader: CheckpointReader, only: Sequence[str] | None, strip_prefix: str | None,
           cast: torch.dtype | None, rename: Renames | None = None) -> tuple[list[Output], dict[str, str]]:
    """The output tensors in source order, and the tied names left out (see ``offline.export``'s docstring)."""
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
    out: list[Output] = []
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
        out.append(Output(name, (), info, dtype))
    if rename is not None:
        rename.check_all_used()
    if not out:
        raise NoModelWeightsError("nothing to export: the rename rules leave every tensor out")
    return out, tied


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
