"""Where each original parameter sits in a rank's flat shard, and how to move members in and out of it.

A runtime flat group holds its members back to back (``FlatLayout``); shard-group rank ``r`` holds
flat elements ``[r * shard_numel, (r + 1) * shard_numel)``, so it holds of member ``j`` a flat range in
the member's own coordinates (possibly starting mid-row). Every conversion of a member is a ``Move``
between those per-rank ranges and the regions another type wants.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from shardckpt.dist import collectives
from shardckpt.dist.group import resolve_group
from shardckpt.regions import FlatRange, Region
from shardckpt.runtime import FlatGroup, FlatLayout
from shardckpt.runtime.build import FLAT_PARAM_NAMES
from shardckpt.runtime.process_groups import Groups
from shardckpt.state_dict.redistribute import Move, exchange

LAYOUTS_KEY = "_flat_layouts"  # in a LOCAL model state dict: {local key: FlatLayout.to_dict()}


def local_key(group: FlatGroup) -> str:
    """The flat parameter's name in the sharded module's own ``state_dict()`` (e.g. ``layers.0._flat_param``)."""
    name = FLAT_PARAM_NAMES[group.layout.requires_grad]
    return f"{group.prefix}.{name}" if group.prefix else name


def held_region(layout: FlatLayout, member: int, rank: int) -> FlatRange | None:
    """The part of member ``member`` that shard-group rank ``rank`` holds, in the member's coordinates."""
    piece = layout.member_in_shard(member, rank)
    return None if piece is None else FlatRange(piece[0], piece[0] + piece[2])


def shard_view(layout: FlatLayout, flat_shard: torch.Tensor, member: int, rank: int) -> torch.Tensor | None:
    """This rank's elements of ``member`` as a view into its flat shard."""
    piece = layout.member_in_shard(member, rank)
    return None if piece is None else flat_shard[piece[1]:piece[1] + piece[2]]


def gather_members(group: FlatGroup, flat_tensors: Sequence[torch.Tensor],
                   wanted: Callable[[tuple[int, ...], int], Region | None]) -> list[list[torch.Tensor | None]]:
    """For each flat-shaped tensor (the parameter shard, or an optimizer state shard) and each member:
    this rank's ``wanted(shape, rank)`` region of the member, as a new tensor (None where it wants none)."""
    layout, rank, world = group.layout, group.groups.shard_rank, group.groups.shard_size
    moves, out = [], []
    for flat in flat_tensors:
        row = []
        for j, shape in enumerate(layout.shapes):
            want = [wanted(shape, q) for q in range(world)]
            dst = torch.empty(want[rank].numel, dtype=flat.dtype, device=flat.device) if want[rank] else None
            held = [held_region(layout, j, q) for q in range(world)]
            moves.append(Move(shape, held, want, shard_view(layout, flat.detach(), j, rank), dst))
            row.append(dst)
        out.append(row)
    exchange(moves, rank, world, group.groups.shard)
    return out


def scatter_members(group: FlatGroup, flat_tensors: Sequence[torch.Tensor],
                    sources: Sequence[Sequence[torch.Tensor | None]],
                    held: Callable[[tuple[int, ...], int], Region | None], everywhere: bool = False,
                    skip: set[int] = frozenset()) -> None:
    """Inverse of ``gather_members``: fill each flat-shaped tensor's shard from member pieces, where rank
    q holds region ``held(shape, q)`` of each member (``sources[i][j]``: this rank's piece, contiguous).
    Members in ``skip`` (the same set on every rank) are left as they are."""
    layout, rank, world = group.layout, group.groups.shard_rank, group.groups.shard_size
    moves = []
    for flat, srcs in zip(flat_tensors, sources):
        for j, shape in enumerate(layout.shapes):
            if j in skip:
                continue
            have = [held(shape, q) for q in range(world)]
            want = [held_region(layout, j, q) for q in range(world)]
            src = srcs[j]
            if src is not None:
                src = src.detach().to(device=flat.device, dtype=flat.dtype).contiguous()
            moves.append(Move(shape, have, want, src, shard_view(layout, flat.detach(), j, rank), everywhere))
    exchange(moves, rank, world, group.groups.shard)


def rank0_shard_rank(groups: Groups) -> int | None:
    """The shard-group rank of global rank 0 if it is in this rank's shard group, else None.

    With ``rank0_only`` only global rank 0 holds full values, so only its replica (its shard group) gathers
    to it or scatters from it; the other replicas of HYBRID_SHARD / NO_SHARD get their shards by
    ``copy_to_replicas``."""
    if groups.shard is None:
        return 0 if resolve_group().rank == 0 else None
    return collectives.group_rank(groups.shard, 0) if 0 in collectives.group_ranks(groups.shard) else None


def replica_source(groups: Groups) -> int:
    """The replicate-group rank of the replica holding global rank 0 (collective over the replicate group)."""
    replicate = resolve_group(groups.replicate) if groups.replicate is not None else None
    if replicate is None or replicate.world_size == 1:
        return 0
    return replicate.all_gather(rank0_shard_rank(groups) is not None).index(True)


def copy_to_replicas(group: FlatGroup, flat_tensors: Sequence[torch.Tensor], source: int) -> None:
    """Copy each flat-shaped tensor's shard from replica ``source`` (see ``replica_source``) to the other
    replicas, which hold the same shard-group rank (collective over the replicate group)."""
    if group.groups.replicate is None:
        return
    replicate = resolve_group(group.groups.replicate)
    if replicate.world_size == 1:
        return
    numel = group.layout.shard_numel
    held = [FlatRange(0, numel) if q == source else None for q in range(replicate.world_size)]
    wanted = [None if q == source else FlatRange(0, numel) for q in range(replicate.world_size)]
    mine = replicate.rank == source
    moves = [Move((numel,), held, wanted, flat.detach() if mine else None, None if mine else flat.detach())
             for flat in flat_tensors]
    exchange(moves, replicate.rank, replicate.world_size, replicate.pg)
