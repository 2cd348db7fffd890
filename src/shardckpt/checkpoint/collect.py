"""Normalise a state dict's tensor leaves (plain tensors, ShardedTensor, DTensor, and the tensors of this rank's
``PerRank`` values) into local pieces."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from shardckpt.errors import UnsupportedValueError
from shardckpt.regions import Box, FlatRange, Region, canonical, full_region
from shardckpt.sharded_tensor import PerRank, ShardedTensor
from shardckpt.format.tree import Path, holds_per_rank, leaf_groups, leaf_path, leaves, path_name
from shardckpt.records import record

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


def is_saved_leaf(value: Any) -> bool:
    """The leaves of a state dict given to save or load: tensors and ``PerRank`` values (a dict holding one is
    not a plain value)."""
    return is_tensor_like(value) or isinstance(value, PerRank)


def per_rank_leaves(path: Path, value: PerRank, rank: int) -> list[tuple[Path, Any]]:
    """The leaves of this rank's ``PerRank`` value at ``path``, with their stored paths (``path + (rank,)``).
    Its tensors are whole tensors of this rank."""
    found = list(leaves(value.value, is_tensor_like, path + (rank,)))
    for found_path, leaf in found:
        if isinstance(leaf, ShardedTensor) or (DTensor and isinstance(leaf, DTensor)):
            raise UnsupportedValueError(f"{path_name(path)!r}: a PerRank holds this rank's whole tensors, not a "
                                        f"{type(leaf).__name__} ({path_name(found_path)!r})")
        if holds_per_rank(leaf):
            raise UnsupportedValueError(f"{path_name(path)!r}: a PerRank may not hold per-rank values")
    return found


@record
class LocalPiece:
    """What one rank holds of one tensor.

    ``data`` holds the elements of ``region`` (shape: the box's sizes, or 1-D for a flat range).
    ``replicated``: every rank holds the same whole tensor (a plain tensor); one rank will store it.
    ``owner``: this rank is the one to store its region (False for a DTensor replica that another rank stores).
    """

    name: str
    data: torch.Tensor
    shape: tuple[int, ...]
    region: Region
    replicated: bool
    owner: bool = True

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _dtensor_piece(name: str, dt: Any) -> LocalPiece:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial, Replicate

    if any(isinstance(p, Partial) for p in dt.placements):
        raise UnsupportedValueError(f"DTensor {name!r} has a Partial placement; reduce it (redistribute) before "
                                    "saving")
    shape = tuple(dt.shape)
    local = dt._local_tensor
    sizes, offsets = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
    coords = dt.device_mesh.get_coordinate()
    # Among replicas of one shard, the one at coordinate 0 of every Replicate mesh dim stores it.
    owner = coords is not None and all(c == 0 for c, p in zip(coords, dt.placements) if isinstance(p, Replicate))
    region: Region = Box(tuple(offsets), tuple(sizes)) if shape else Box((), ())
    if math.prod(sizes) == 0:
        region = FlatRange(0, 0)
        local = local.reshape(-1)[:0]
    return LocalPiece(name, local.detach(), shape, region, replicated=False, owner=owner)


def to_piece(name: str, value: Any) -> LocalPiece:
    """The piece of the leaf ``value`` named ``name``. Its data is a detached view of the leaf's memory, a tensor object
    of its own: a caller's later change to the leaf's object (``t.data = ...``, ``t.t_()``, ``resize_``) does not reach
    a save staged from it, and autograd does not track it."""
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the common case, checked first
        return LocalPiece(name, value.detach(), tuple(value.shape), FlatRange(0, value.numel()), replicated=True)
    if isinstance(value, ShardedTensor):
        return LocalPiece(name, value.local.detach(), value.global_shape, value.region, replicated=False)
    if DTensor and isinstance(value, DTensor):
        return _dtensor_piece(name, value)
    if isinstance(value, torch.Tensor):
        return LocalPiece(name, value.detach(), tuple(value.shape), full_region(value.shape), replicated=True)
    raise UnsupportedValueError(f"{name!r} is not a tensor")


def local_pieces(state_dict: Any, rank: int = 0,
                 check: Callable[[str, torch.Tensor], None] | None = None) -> list[LocalPiece]:
    """Every tensor leaf of ``state_dict``, in traversal order; a tensor of this rank's ``PerRank`` value is a
    piece only this rank holds, named with the rank (``rng.1``). ``check(name, tensor)`` sees each leaf first."""
    if not isinstance(state_dict, dict):
        raise UnsupportedValueError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    out = []
    for parent, keys, names, values in leaf_groups(state_dict, is_saved_leaf):
        for i, (name, v) in enumerate(zip(names, values)):
            if isinstance(v, PerRank):
                own = [(path_name(p), t) for p, t in per_rank_leaves(leaf_path(parent, keys, i), v, rank)
                       if is_tensor_like(t)]
                for n, t in own if check is not None else ():
                    check(n, t)
                out += [LocalPiece(n, t.detach(), tuple(t.shape), full_region(t.shape), replicated=False)
                        for n, t in own]
            elif is_tensor_like(v):
                if check is not None and isinstance(v, torch.Tensor):
                    check(name, v)
                out.append(to_piece(name, v))
    return out


def region_key(region: Region, shape: tuple[int, ...]) -> tuple:
    """A plain, picklable description of a region (for planning messages)."""
    r = canonical(region, shape)
    return ("flat", r.start, r.stop) if isinstance(r, FlatRange) else ("box", r.offsets, r.sizes)


def region_from_key(key: tuple) -> Region:
    return FlatRange(key[1], key[2]) if key[0] == "flat" else Box(key[1], key[2])
