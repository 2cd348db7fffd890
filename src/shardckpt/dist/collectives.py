"""The tensor collectives of the sharding runtime and the state-dict layer, and the process-group queries and
creation they rely on. With group.py (object collectives) and world.py (joining a world), this package is
the only one that talks to torch.distributed.

A group of `None` is a world of one (also what a single process without any process group gets): the
collectives become local copies. Where a backend lacks a collective, it is emulated here (and only here)
with the ones it has.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps builds without distributed importable

# (backend, collective) pairs that raised "unsupported" once: emulated from then on.
_EMULATED: set[tuple[str, str]] = set()
_UNSUPPORTED_MARKERS = ("not supported", "does not support", "unsupported", "not implemented")

_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


class Handle:
    """A collective in flight; `wait()` blocks until its result is in place (idempotent)."""

    def __init__(self, work: Any = None, then: Callable[[], None] | None = None) -> None:
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group))


def world() -> ProcessGroup | None:
    """The default group (every rank) if torch.distributed is initialised, else None (a world of one)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks in `group` (a real group, not None), in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def group_rank(group: ProcessGroup, global_rank: int) -> int:
    """`global_rank`'s rank within `group` (it must be a member)."""
    return dist.get_group_rank(group, global_rank)


def new_group(ranks: list[int]) -> ProcessGroup:
    """A process group of the given global ranks; every rank of the world must call this, in the same order."""
    return dist.new_group(ranks)


def is_mesh(obj: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def _try_native(name: str, group: ProcessGroup, call: Callable[[], Any], emulate: Callable[[], Handle]) -> Handle:
    key = (backend(group), name)
    if key not in _EMULATED:
        try:
            return Handle(call())
        except (RuntimeError, NotImplementedError) as exc:
            if not any(marker in str(exc).lower() for marker in _UNSUPPORTED_MARKERS):
                raise
            _EMULATED.add(key)
    return emulate()


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, async_op: bool = False) -> Handle:
    """Concatenate every rank's equal-sized `shard` into `out` (1-D, size(group) * shard.numel())."""
    if size(group) == 1:
        out.copy_(shard)
        return Handle()

    def emulate() -> Handle:
        return Handle(dist.all_gather(list(out.chunk(size(group))), shard, group=group, async_op=async_op))

    if _all_gather_single is None:
        return emulate()
    return _try_native("all_gather", group, lambda: _all_gather_single(out, shard, group=group, async_op=async_op),
                       emulate)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None,
                   async_op: bool = False) -> Handle:
    """Sum `full` (1-D) over the group; rank r receives elements [r * n, (r + 1) * n) in `out` (n = out.numel())."""
    if size(group) == 1:
        out.copy_(full)
        return Handle()

    def emulate() -> Handle:
        # All-reduce a copy, then keep this rank's slice: twice the traffic, same result.
        summed = full.clone()
        work = dist.all_reduce(summed, group=group, async_op=async_op)
        n = out.numel()
        return Handle(work, lambda: out.copy_(summed[rank(group) * n:(rank(group) + 1) * n]))

    if _reduce_scatter_single is None:
        return emulate()
    return _try_native("reduce_scatter", group,
                       lambda: _reduce_scatter_single(out, full, group=group, async_op=async_op), emulate)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = False,
               op: str = "sum") -> Handle:
    """In-place all-reduce; `op` is 'sum' or 'max'."""
    if size(group) == 1:
        return Handle()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    return Handle(dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, group: ProcessGroup | None, group_src: int = 0) -> None:
    """In place: every rank of ``group`` gets the values of its rank ``group_src`` (blocking)."""
    if size(group) == 1:
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group, group_src), group=group)


def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int],
                      group: ProcessGroup | None) -> None:
    """Rank r sends `send`'s consecutive pieces of `send_sizes[q]` elements to rank q and receives rank q's
    piece for it into `recv`'s consecutive pieces of `recv_sizes[q]` elements (1-D tensors; blocking)."""
    if size(group) == 1:
        recv.copy_(send)
        return
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
