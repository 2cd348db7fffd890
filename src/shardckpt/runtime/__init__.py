"""shardckpt's training-side sharding runtime: flat groups, ZeRO-3 style, every state-dict type native.

    from shardckpt.runtime import shard, ShardingStrategy, MixedPrecision
    model = shard(model, strategy=ShardingStrategy.FULL_SHARD, wrap=(Block,))
    optim = torch.optim.AdamW(model.parameters())   # the local flat shards: optimizer state is sharded too

See docs/runtime.md for the design and `FlatLayout` for the contract LOCAL state dicts rely on.
"""
from __future__ import annotations

from shardckpt.runtime.api import (
    ShardedModule,
    ShardedUnit,
    UnshardHandle,
    clip_grad_norm_,
    groups,
    is_sharded,
    no_sync,
    shard,
    summon_full_params,
)
from shardckpt.runtime.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from shardckpt.runtime.flat_group import FlatGroup
from shardckpt.format.flat_layout import ALIGN_BYTES, FlatLayout

__all__ = [
    "ALIGN_BYTES",
    "BackwardPrefetch",
    "FlatGroup",
    "FlatLayout",
    "MixedPrecision",
    "ShardedModule",
    "ShardedUnit",
    "ShardingStrategy",
    "clip_grad_norm_",
    "groups",
    "is_sharded",
    "no_sync",
    "shard",
    "summon_full_params",
    "UnshardHandle",
]
