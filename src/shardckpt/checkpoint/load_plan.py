"""Matching a state dict's leaves to a manifest, and planning which chunk bytes each target needs (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardckpt.checkpoint.collect import is_tensor_like, to_piece
from shardckpt.errors import IncompatibleCheckpointError, key_mismatch
from shardckpt.regions import FlatRange, Region, canonical, flat_bounds, intersect, local_span
from shardckpt.format.chunks import RegularChunks
from shardckpt.format.manifest import Manifest, TensorEntry
from shardckpt.format.tree import Path, TensorRef, leaves, path_name


@dataclass
class Target:
    """A tensor to fill: ``flat`` is a 1-D view of the storage of ``region``'s elements."""

    name: str
    entry: TensorEntry
    region: Region
    dest: torch.Tensor  # the caller's tensor (local shard)
    flat: torch.Tensor  # 1-D contiguous view of ``dest``'s storage, or a staging copy
    staged: bool  # True: ``flat`` is a copy to write back into ``dest`` at the end

    def __post_init__(self) -> None:
        # Once here rather than per chunk: a dim-0 chunk becomes a flat range, the fast case of planning.
        self.region = canonical(self.region, self.entry.shape)


@dataclass
class ChunkRead:
    """Elements ``[lo, hi)`` of one stored chunk, and the pieces of targets they fill."""

    entry: TensorEntry
    chunk: int
    file: int
    region: Region
    lo: int
    hi: int
    copies: list[tuple[Region, Target]] = field(default_factory=list)


def _make_target(path: Path, value: Any, entry: TensorEntry, strict: bool) -> Target:
    piece = to_piece(path, value)
    name = piece.name
    if piece.shape != entry.shape:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds shape {list(entry.shape)}, the "
                                          f"state dict expects {list(piece.shape)}")
    dest = piece.data.detach()
    if dest.dtype != entry.dtype and strict:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds {entry.dtype}, the state dict "
                                          f"expects {dest.dtype} (load with strict=False to cast)")
    if dest.is_contiguous():
        return Target(name, entry, piece.region, dest, dest.reshape(-1), staged=False)
    return Target(name, entry, piece.region, dest, dest.contiguous().reshape(-1), staged=True)


def match(manifest: Manifest, state_dict: dict, strict: bool) -> tuple[list[Target], list[tuple[Path, Any]]]:
    """Targets for the tensors and ``(path, saved value)`` for the plain values; strict raises on any mismatch."""
    saved = {path_name(p): v for p, v in leaves(manifest.tree, lambda v: isinstance(v, TensorRef))}
    wanted = list(leaves(state_dict, is_tensor_like))
    names = {path_name(p) for p, _ in wanted}
    targets, values, missing = [], [], []
    for path, value in wanted:
        name = path_name(path)
        if name not in saved:
            missing.append(name)
            continue
        stored = saved[name]
        if is_tensor_like(value) != isinstance(stored, TensorRef):
            kinds = ("a tensor", "a plain value")
            raise IncompatibleCheckpointError(
                f"{name!r}: the checkpoint holds {kinds[not isinstance(stored, TensorRef)]}, the state dict "
                f"{kinds[not is_tensor_like(value)]}")
        if isinstance(stored, TensorRef):
            targets.append(_make_target(path, value, manifest.tensors[stored.name], strict))
        else:
            values.append((path, stored))
    unexpected = sorted(set(saved) - names)
    if strict and (missing or unexpected):
        raise key_mismatch("state dict and checkpoint do not match (missing: in the state dict, not the "
                           "checkpoint)", missing, unexpected, "Pass strict=False to load the keys both have.")
    return targets, values


def plan_reads(targets: list[Target]) -> list[ChunkRead]:
    """For each stored chunk some target overlaps: the element span to read and the pieces to copy."""
    reads: dict[tuple[str, int], ChunkRead] = {}
    for target in targets:
        if isinstance(target.region, FlatRange) and isinstance(target.entry.chunks, RegularChunks):
            _plan_flat_regular(target, reads)
        else:
            _plan_general(target, reads)
    return list(reads.values())


def _read_for(reads: dict, entry: TensorEntry, i: int, region: Region) -> ChunkRead:
    read = reads.get((entry.name, i))
    if read is None:
        read = reads[(entry.name, i)] = ChunkRead(entry, i, entry.chunks.file(i), region, region.numel, 0)
    return read


def _plan_flat_regular(target: Target, reads: dict) -> None:
    """A flat range against regular flat chunks (the FSDP case at scale): integer arithmetic only."""
    entry, (lo, hi) = target.entry, (target.region.start, target.region.stop)
    size, numel = entry.chunks.size, entry.numel
    for i in entry.chunks.overlapping(lo, hi):
        start, stop = i * size, min((i + 1) * size, numel)
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        read = reads.get((entry.name, i))
        if read is None:
            read = reads[(entry.name, i)] = ChunkRead(entry, i, entry.chunks.file(i), FlatRange(start, stop),
                                                      a - start, b - start)
        else:
            read.lo, read.hi = min(read.lo, a - start), max(read.hi, b - start)
        read.copies.append((target.region if (a, b) == (lo, hi) else FlatRange(a, b), target))


def _plan_general(target: Target, reads: dict) -> None:
    entry = target.entry
    lo, hi = flat_bounds(target.region, entry.shape)
    for i in entry.chunks.overlapping(lo, hi):
        region = entry.chunks.region(i, entry.numel)
        pieces = intersect(region, target.region, entry.shape)
        if not pieces:
            continue
        read = _read_for(reads, entry, i, region)
        for piece in pieces:
            a, b = local_span(piece, region, entry.shape)
            read.lo, read.hi = min(read.lo, a), max(read.hi, b)
            read.copies.append((piece, target))
