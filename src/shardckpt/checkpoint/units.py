"""An incremental save's units (docs/design/incremental.md, 4.2): every planned chunk cut at the tensor's own
multiples of ``unit_bytes`` (``format.chunk_identity.unit_bounds``), so that an unchanged part of a large tensor is
an unchanged chunk, and after a reshard only the units a shard boundary cuts differ. Pure, but for slicing the
staged tensors (views, no copies)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import SavePlan, TensorPlan, WriteTask, itemsize_of
from shardckpt.format.chunk_identity import unit_bounds, unit_length
from shardckpt.regions import Box, FlatRange, Region, flat_bounds
from shardckpt.tensor_views import as_bytes

DEFAULT_UNIT_BYTES = 4 << 20


def cut_region(region: Region, shape: tuple[int, ...], itemsize: int, unit_bytes: int) -> list[Region]:
    """``region`` cut into units: a flat range at multiples of ``unit_length`` elements; a box that spans every
    dim but the first at multiples of whole rows; any other box stays one unit."""
    if isinstance(region, FlatRange):
        step = unit_length(itemsize, unit_bytes)
        return [FlatRange(a, b) for a, b in unit_bounds(region.start, region.stop, step)]
    if isinstance(region, Box) and shape and tuple(region.sizes[1:]) == tuple(shape[1:]) and region.sizes[0]:
        row = math.prod(shape[1:])
        step = unit_length(itemsize, unit_bytes, max(row, 1))
        first = region.offsets[0]
        return [Box((a,) + tuple(region.offsets[1:]), (b - a,) + tuple(region.sizes[1:]))
                for a, b in unit_bounds(first, first + region.sizes[0], step)]
    return [region]


def unit_plan(save_plan: SavePlan, unit_bytes: int) -> SavePlan:
    """``save_plan`` with every chunk cut into units (same writer, same slot), the tasks renumbered."""
    tensors: dict[str, TensorPlan] = {}
    tasks: list[list[WriteTask]] = [[] for _ in save_plan.tasks]
    for name, plan in save_plan.tensors.items():
        cut = TensorPlan(plan.dtype, plan.shape, slot=plan.slot)
        for region, rank in zip(plan.regions, plan.writers):
            for unit in cut_region(region, plan.shape, itemsize_of(plan.dtype), unit_bytes):
                tasks[rank].append(WriteTask(name, len(cut.regions), plan.slot))
                cut.regions.append(unit)
                cut.writers.append(rank)
        tensors[name] = cut
    return dataclasses.replace(save_plan, tensors=tensors, tasks=tasks)


@dataclass(frozen=True)
class UnitPiece(LocalPiece):
    """One unit of a staged piece (a view of its data), with the digest of its bytes once hashed."""

    digest: bytes | None = None
    hash_key: bytes | None = None  # the pool's key: the writer hashes the bytes it writes (they must match digest)


def unit_piece(piece: LocalPiece, unit: Region) -> UnitPiece:
    """The part of ``piece`` (this rank's staged data of one tensor) that ``unit`` covers: a contiguous view. The plan
    may hold a piece's region in canonical form (a box of whole rows as a flat range), so units are found by their
    flat bounds, but for a box cut by rows out of a box."""
    data = piece.data
    if unit == piece.region:
        view = data
    elif isinstance(unit, Box) and isinstance(piece.region, Box):
        first = piece.region.offsets[0]
        view = data[unit.offsets[0] - first:unit.offsets[0] - first + unit.sizes[0]]
    else:  # one flat run inside a piece that is one flat run
        start = flat_bounds(piece.region, piece.shape)[0]
        lo, hi = flat_bounds(unit, piece.shape)
        view = data.reshape(-1)[lo - start:hi - start]
    return UnitPiece(piece.name, view, piece.shape, unit, piece.replicated, piece.owner)


def unit_bytes_of(piece: UnitPiece) -> torch.Tensor:
    """The unit's bytes on the host, flat (a CUDA piece a synchronous save kept on its device is copied)."""
    data = piece.data if piece.data.device.type == "cpu" else piece.data.cpu()
    return as_bytes(data.contiguous())
