"""Where each original parameter sits in a rank's flat shard, and how to move members in and out of it.

A runtime flat group holds its members back to back (``FlatLayout``); shard-group rank ``r`` holds
flat elements ``[r * shard_numel, (r + 1) * shard_numel)``, so it holds of member ``j`` a flat range in
the member's own coordinates (possibly starting mid-row). Every conversion of a member is a ``Move``
between those per-rank ranges and the regions another type wants.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from shardckpt.dist import collectives
from shardckpt.dist.group import resolve_group
from shardckpt.format.flat_layout import FlatLayout
from shardckpt.regions import FlatRange, Region
from shardckpt.runtime import FlatGroup
from shardckpt.runtime.build import FLAT_PARAM_NAMES
from shardckpt.runtime.process_groups import Groups
from shardckpt.state_dict.redistribute import Move, exchange


def local_key(group: FlatGroup) -> str:
    """The flat parameter's name in the sharded module's own ``state_dict()`` (e.g. ``layers.0._flat_param``)."""
    name = FLAT_PARAM_NAMES[group.layout.requires_grad]
    return f"{group.prefix}.{name}" if group.prefix else name


def held_region(layout: FlatLayout, member: int, rank: int) -> FlatRange | None:
    """The part of member ``member`` that shard-group rank ``rank`` holds, in the member's coordinates."""
    held = layout.held(member, rank)
    return None if held is None else held.here


def shard_view(layout: FlatLayout, flat_shard: torch.Tensor, member: int, rank: int) -> torch.Tensor | None:
    """This rank's elements of ``member`` as a view into its flat shard."""
    held = layout.held(member, rank)
    return None if held is None else flat_shard[held.start:held.start + held.count]


MemberPiece = tuple[int, Optional[torch.Tensor], torch.Tensor]
"""(member index, this rank's elements of that member inside some tensor sharded like it, as a 1-D view, or None
where it holds none of it; a tensor whose dtype and device the member's values take)."""


def flat_pieces(group: FlatGroup, flat: torch.Tensor) -> list[MemberPiece]:
    """Every member's piece of a flat-shard-shaped tensor (the flat parameter, or optimizer state shaped like it)."""
    layout, rank = group.layout, group.groups.shard_rank
    return [(j, shard_view(layout, flat.detach(), j, rank), flat) for j in range(len(layout.names))]


@dataclass(frozen=True)
class Held:
    """A parameter of a sharded model as an optimizer holds it: a flat group's whole local shard (every member),
    or with ``use_orig_params`` one member's piece (``FlatGroup.orig_params``). Optimizer state shaped like
    ``param`` is sharded like it."""

    group: FlatGroup
    members: tuple[int, ...]
    param: torch.Tensor

    @property
    def whole_shard(self) -> bool:
        return self.param is self.group.flat_param

    @property
    def names(self) -> list[str]:
        """The primary names of its members."""
        return [self.group.layout.names[j] for j in self.members]

    def pieces(self, tensor: torch.Tensor) -> list[MemberPiece]:
        """Each member's piece of ``tensor`` (the parameter, or optimizer state shaped like it)."""
        if self.whole_shard:
            return flat_pieces(self.group, tensor)
        (j,) = self.members
        held = held_region(self.group.layout, j, self.group.groups.shard_rank) is not None
        return [(j, tensor.detach().reshape(-1) if held else None, tensor)]


def held_params(groups: Sequence[FlatGroup]) -> dict[int, Held]:
    """id(parameter) -> ``Held``, for every flat shard and every original parameter of these groups."""
    out = {}
    for group in groups:
        out[id(group.flat_param)] = Held(group, tuple(range(len(group.layout.names))), group.flat_param)
        for j, param in enumerate(group.orig_params or ()):
            out[id(param)] = Held(group, (j,), param)
    return out


def gather_members(group: FlatGroup, pieces: Sequence[MemberPiece],
                   wanted: Callable[[tuple[int, ...], int], Region | None]) -> list[torch.Tensor | None]:
    """For each member piece: this rank's ``wanted(shape, rank)`` region of that member, as a new tensor (None
    where it wants none). One exchange for all of them."""
    layout, rank, world = group.layout, group.groups.shard_rank, group.groups.shard_size
    moves, out = [], []
    for j, piece, like in pieces:
        shape = layout.shapes[j]
        want = [wanted(shape, q) for q in range(world)]
        dst = torch.empty(want[rank].numel, dtype=like.dtype, device=like.device) if want[rank] else None
        held = [held_region(layout, j, q) for q in range(world)]
        moves.append(Move(shape, held, want, piece, dst))
        out.append(dst)
    exchange(moves, rank, world, group.groups.shard)
    return out


def scatter_members(group: FlatGroup, pieces: Sequence[MemberPiece], sources: Sequence[torch.Tensor | None],
                    held: Callable[[tuple[int, ...], int], Region | None], everywhere: bool = False) -> None:
    """Inverse of ``gather_members``: fill each member piece from ``sources`` (this rank's part of that member,
    contiguous, or None), where rank q holds region ``held(shape, q)`` of each member. Members not listed (the
    same on every rank) are left as they are."""
    layout, rank, world = group.layout, group.groups.shard_rank, group.groups.shard_size
    moves = []
    for (j, piece, like), src in zip(pieces, sources):
        shape = layout.shapes[j]
        have = [held(shape, q) for q in range(world)]
        want = [held_region(layout, j, q) for q in range(world)]
        if src is not None:
            src = src.detach().to(device=like.device, dtype=like.dtype).contiguous()
        moves.append(Move(shape, have, want, src, piece, everywhere))
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
    """Copy each tensor sharded like the group (its flat shard, or a member's piece) from replica ``source`` (see ``replica_source``) to the other
    replicas, which hold the same shard-group rank (collective over the replicate group)."""
    if group.groups.replicate is None:
        return
    replicate = resolve_group(group.groups.replicate)
    if replicate.world_size == 1:
        return
    mine = replicate.rank == source
    moves = []
    for flat in flat_tensors:  # a flat shard, or an original parameter's piece: the same size on every replica
        whole = FlatRange(0, flat.numel())
        held = [whole if q == source else None for q in range(replicate.world_size)]
        wanted = [None if q == source else whole for q in range(replicate.world_size)]
        moves.append(Move((flat.numel(),), held, wanted, flat.detach().reshape(-1) if mine else None,
                          None if mine else flat.detach().reshape(-1)))
    exchange(moves, replicate.rank, replicate.world_size, replicate.pg)
