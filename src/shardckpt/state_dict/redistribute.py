"""Moving tensor regions between ranks: one engine for every in-training state-dict conversion.

Each logical tensor is described by which region every rank *holds* and which region every rank
*wants*. The transfers are the intersections (``regions.intersect``): pieces a rank holds and wants
itself are copied locally, the others travel in one ``all_to_all_single`` of bytes per call. Flat
shards -> dim-0 chunks (SHARDED), flat shards -> whole tensors on every rank or on rank 0 (FULL,
``rank0_only``), and the inverse directions are all this one exchange with different regions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardckpt.dist import collectives
from shardckpt.regions import Region, dim0_chunk, full_region, intersect, strided_view
from shardckpt.tensor_views import as_bytes, from_bytes, view_of


@dataclass(frozen=True)
class Move:
    """One tensor's redistribution over a group of ``len(held)`` ranks.

    ``held[r]``/``wanted[r]``: the region rank r holds / wants (None for nothing). Held regions must be
    disjoint, unless ``everywhere`` says every rank holds the whole tensor (then all copies are local).
    ``src``/``dst``: this rank's local storage of its held / wanted region (contiguous), or None.
    """

    shape: tuple[int, ...]
    held: Sequence[Region | None]
    wanted: Sequence[Region | None]
    src: torch.Tensor | None
    dst: torch.Tensor | None
    everywhere: bool = False

    def pieces(self, source: int, target: int) -> list[Region]:
        """What rank ``source`` sends to rank ``target`` (the same list on both ranks)."""
        held, wanted = self.held[source], self.wanted[target]
        if held is None or wanted is None or (self.everywhere and source != target):
            return []
        return intersect(held, wanted, self.shape)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _copy_piece(move: Move, piece: Region, rank: int) -> None:
    src = view_of(_flat(move.src), strided_view(piece, move.held[rank], move.shape))
    view_of(move.dst.reshape(-1), strided_view(piece, move.wanted[rank], move.shape)).copy_(src)


def exchange(moves: list[Move], rank: int, world: int, group: Any = None) -> None:
    """Fill every move's ``dst`` on every rank; collective over ``group`` when ``world > 1``."""
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(world)]
    incoming: list[list[tuple[Move, Region]]] = [[] for _ in range(world)]
    device = None
    for move in moves:
        for piece in move.pieces(rank, rank):
            _copy_piece(move, piece, rank)
        for other in range(world):
            if other == rank:
                continue
            for piece in move.pieces(rank, other):
                src = view_of(_flat(move.src), strided_view(piece, move.held[rank], move.shape))
                outgoing[other].append(as_bytes(src.contiguous()))
                device = src.device
            incoming[other].extend((move, piece) for piece in move.pieces(other, rank))
    if world == 1:
        return
    device = device or next((m.dst.device for m in moves if m.dst is not None), torch.device("cpu"))
    send_sizes = [sum(b.numel() for b in parts) for parts in outgoing]
    recv_sizes = [sum(p.numel * m.dst.element_size() for m, p in parts) for parts in incoming]
    send = torch.cat([b.to(device) for parts in outgoing for b in parts]) if sum(send_sizes) else \
        torch.empty(0, dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    collectives.all_to_all_single(recv, send, recv_sizes, send_sizes, group)
    pos = 0
    for parts in incoming:
        for move, piece in parts:
            n = piece.numel * move.dst.element_size()
            data = from_bytes(recv[pos:pos + n], move.dst.dtype, (piece.numel,))
            target = view_of(move.dst.reshape(-1), strided_view(piece, move.wanted[rank], move.shape))
            target.copy_(data.reshape(target.shape))
            pos += n


def assemble_chunks(chunks: dict[str, Any], rank: int, world: int, group: Any = None) -> dict[str, torch.Tensor]:
    """Whole tensors on every rank from each rank's dim-0 ``ShardedTensor`` chunk (collective)."""
    out, moves = {}, []
    for name, value in chunks.items():
        shape = value.global_shape
        out[name] = torch.empty(shape, dtype=value.dtype, device=value.device)
        moves.append(Move(shape, [dim0_chunk(shape, q, world) for q in range(world)], [full_region(shape)] * world,
                          value.local, out[name]))
    exchange(moves, rank, world, group)
    return out
