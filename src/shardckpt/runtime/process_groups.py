"""The process groups a flat parameter is sharded and replicated over: `shard(strategy=..., process_group=...)`
resolved into `Groups`, checked against the strategy and the device. Every query and group creation goes
through `shardckpt.dist.collectives`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from shardckpt.dist import collectives
from shardckpt.dist.collectives import ProcessGroup, rank, size
from shardckpt.errors import ShardingError
from shardckpt.runtime.config import ShardingStrategy


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


def resolve_groups(strategy: ShardingStrategy, process_group: Any, device: torch.device) -> Groups:
    """Turn `shard(process_group=...)` into Groups, checking that it fits the strategy and the device."""
    groups = _resolve(strategy, process_group, device)
    for group in (groups.shard, groups.replicate):
        if group is not None and collectives.backend(group) == "nccl" and device.type != "cuda":
            raise ShardingError(f"the process group uses NCCL, which needs CUDA tensors, but the parameters "
                                f"are on {device}; move the module to a CUDA device or use a gloo group")
    return groups


def _resolve(strategy: ShardingStrategy, process_group: Any, device: torch.device) -> Groups:
    if process_group is None:
        world = collectives.world()
        if world is None:
            return Groups(None, None)
        if strategy is ShardingStrategy.HYBRID_SHARD:
            return _default_hybrid_groups()
        return Groups(None, world) if strategy is ShardingStrategy.NO_SHARD else Groups(world, None)
    if collectives.is_mesh(process_group):
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
    world = size(collectives.world())
    me = rank(collectives.world())
    shard_ranks = set(collectives.group_ranks(groups.shard))
    replicate_ranks = set(collectives.group_ranks(groups.replicate))
    if len(shard_ranks) * len(replicate_ranks) != world or shard_ranks & replicate_ranks != {me}:
        raise ShardingError(
            f"HYBRID_SHARD groups do not match a (replicate, shard) mesh of the {world} ranks: shard group "
            f"{sorted(shard_ranks)}, replicate group {sorted(replicate_ranks)} on rank {me}; "
            "their sizes must multiply to the world size and they must share only this rank")
    return groups


_DEFAULT_HYBRID: dict[tuple[int, int], Groups] = {}


def _default_hybrid_groups() -> Groups:
    """Shard within blocks of LOCAL_WORLD_SIZE consecutive ranks (a node), replicate across blocks."""
    world = size(collectives.world())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        local = world
    # Made once per default group: every rank must create every group, and groups are not free.
    key = (id(collectives.world()), local)
    if key not in _DEFAULT_HYBRID:
        _DEFAULT_HYBRID[key] = _block_groups(world, local)
    return _DEFAULT_HYBRID[key]


def _block_groups(world: int, local: int) -> Groups:
    me = rank(collectives.world())
    shard = replicate = None
    for start in range(0, world, local):
        group = collectives.new_group(list(range(start, start + local)))
        shard = group if start <= me < start + local else shard
    for offset in range(local):
        group = collectives.new_group(list(range(offset, world, local)))
        replicate = group if me % local == offset else replicate
    return Groups(shard, replicate)
