"""Every collective the runtime issues, and the process groups it issues them on.

Only this module talks to torch.distributed. A group of `None` is a world of one (also what a single
process without any process group gets): the collectives become local copies. Where a backend lacks
a collective, it is emulated here (and only here) with the ones it has.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardckpt.errors import ShardingError
from shardckpt.runtime.config import ShardingStrategy

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


def _backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group))


def _try_native(name: str, group: ProcessGroup, call: Callable[[], Any], emulate: Callable[[], Handle]) -> Handle:
    key = (_backend(group), name)
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


@dataclass(frozen=True)
class Groups:
    """The two groups a flat parameter lives on: `shard` splits it, `replicate` holds copies of each shard.

    FULL_SHARD / SHARD_GRAD_OP: shard = the data-parallel group, replicate = None.
    NO_SHARD: shard = None, replicate = the data-parallel group. HYBRID_SHARD: both.
    """

    shard: ProcessGroup | None
    replicate: ProcessGroup | None

    @property
    def shard_size(self) -> int:
        return size(self.shard)

    @property
    def shard_rank(self) -> int:
        return rank(self.shard)

    @property
    def data_parallel_size(self) -> int:
        return size(self.shard) * size(self.replicate)


def _is_mesh(obj: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def resolve_groups(strategy: ShardingStrategy, process_group: Any, device: torch.device) -> Groups:
    """Turn `shard(process_group=...)` into Groups, checking that it fits the strategy and the device."""
    groups = _resolve(strategy, process_group, device)
    for group in (groups.shard, groups.replicate):
        if group is not None and _backend(group) == "nccl" and device.type != "cuda":
            raise ShardingError(f"the process group uses NCCL, which needs CUDA tensors, but the parameters "
                                f"are on {device}; move the module to a CUDA device or use a gloo group")
    return groups


def _resolve(strategy: ShardingStrategy, process_group: Any, device: torch.device) -> Groups:
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Groups(None, None)
        world = dist.group.WORLD
        if strategy is ShardingStrategy.HYBRID_SHARD:
            return _default_hybrid_groups()
        return Groups(None, world) if strategy is ShardingStrategy.NO_SHARD else Groups(world, None)
    if _is_mesh(process_group):
        return _groups_from_mesh(strategy, process_group, device)
    if isinstance(process_group, tuple):
        if strategy is not ShardingStrategy.HYBRID_SHARD or len(process_group) != 2:
            raise ShardingError(f"a tuple of process groups is only for HYBRID_SHARD, as (shard_group, "
                                f"replicate_group); got {len(process_group)} groups with {strategy.name}")
        return _check_hybrid(Groups(*process_group))
    if strategy is ShardingStrategy.HYBRID_SHARD:
        raise ShardingError("HYBRID_SHARD needs two groups: pass (shard_group, replicate_group) or a 2-D "
                            "DeviceMesh (replicate, shard), not a single process group")
    return Groups(None, process_group) if strategy is ShardingStrategy.NO_SHARD else Groups(process_group, None)


def _groups_from_mesh(strategy: ShardingStrategy, mesh: Any, device: torch.device) -> Groups:
    if mesh.device_type != device.type:
        raise ShardingError(f"the DeviceMesh is for device type {mesh.device_type!r} but the parameters "
                            f"are on {device}; build the mesh for {device.type!r}")
    want = 2 if strategy is ShardingStrategy.HYBRID_SHARD else 1
    if mesh.ndim != want:
        raise ShardingError(f"{strategy.name} needs a {want}-D DeviceMesh"
                            f"{' (replicate, shard)' if want == 2 else ''}, got a {mesh.ndim}-D mesh")
    if want == 2:
        return _check_hybrid(Groups(shard=mesh.get_group(1), replicate=mesh.get_group(0)))
    return _resolve(strategy, mesh.get_group(0), device)


def _check_hybrid(groups: Groups) -> Groups:
    """The shard and replicate groups must tile the world: sizes multiply to it, and meet only in this rank."""
    world = dist.get_world_size()
    shard_ranks = set(dist.get_process_group_ranks(groups.shard))
    replicate_ranks = set(dist.get_process_group_ranks(groups.replicate))
    if len(shard_ranks) * len(replicate_ranks) != world or shard_ranks & replicate_ranks != {dist.get_rank()}:
        raise ShardingError(
            f"HYBRID_SHARD groups do not match a (replicate, shard) mesh of the {world} ranks: shard group "
            f"{sorted(shard_ranks)}, replicate group {sorted(replicate_ranks)} on rank {dist.get_rank()}; "
            "their sizes must multiply to the world size and they must share only this rank")
    return groups


_DEFAULT_HYBRID: dict[tuple[int, int], Groups] = {}


def _default_hybrid_groups() -> Groups:
    """Shard within blocks of LOCAL_WORLD_SIZE consecutive ranks (a node), replicate across blocks."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        local = world
    # Made once per default group: every rank must create every group, and groups are not free.
    key = (id(dist.group.WORLD), local)
    if key not in _DEFAULT_HYBRID:
        _DEFAULT_HYBRID[key] = _block_groups(world, local)
    return _DEFAULT_HYBRID[key]


def _block_groups(world: int, local: int) -> Groups:
    me = dist.get_rank()
    shard = replicate = None
    for start in range(0, world, local):
        group = dist.new_group(list(range(start, start + local)))
        shard = group if start <= me < start + local else shard
    for offset in range(local):
        group = dist.new_group(list(range(offset, world, local)))
        replicate = group if me % local == offset else replicate
    return Groups(shard, replicate)

