"""User-facing configuration of the sharding runtime: the strategy, the mixed-precision policy and the
backward prefetch."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from shardckpt.errors import ShardingError


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks (FSDP's names)."""

    FULL_SHARD = "full_shard"
    """Shard everything; all-gather before forward and again before backward, free after each (ZeRO-3)."""
    SHARD_GRAD_OP = "shard_grad_op"
    """Shard everything, but keep the gathered parameters from forward until after backward (ZeRO-2 like)."""
    NO_SHARD = "no_shard"
    """Replicate (DDP): every rank holds whole flat parameters; gradients are all-reduced."""
    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD within a shard group, replicated across groups; gradients reduce-scattered then all-reduced."""


class BackwardPrefetch(enum.Enum):
    """When backward starts the all-gather of the unit it runs next (FSDP1's names; torch's own
    ``torch.distributed.fsdp.BackwardPrefetch`` is accepted by name)."""

    BACKWARD_PRE = "backward_pre"
    """As a unit's backward starts (most overlap; two units gathered at once)."""
    BACKWARD_POST = "backward_post"
    """Once a unit's gradient is ready (less memory: the next unit is gathered only after this one is freed)."""


def backward_prefetch_of(value: object) -> BackwardPrefetch | None:
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    name = getattr(value, "name", None)
    if name in BackwardPrefetch.__members__:
        return BackwardPrefetch[name]
    raise ShardingError(f"backward_prefetch must be a BackwardPrefetch (BACKWARD_PRE, BACKWARD_POST) or None, got "
                        f"{value!r}")


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers; `None` keeps the master dtype (or param_dtype).

    The master weights (the local flat shards the optimizer steps) keep their original dtype.
    `param_dtype` is what forward and backward compute in (floating inputs of the root forward are
    cast to it too); `reduce_dtype` is what gradients are communicated in (default: `param_dtype`);
    `buffer_dtype` is what floating buffers are cast to, once, when the module is sharded (as FSDP1).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ShardingError(f"MixedPrecision.{field} must be a floating torch.dtype or None, got {value!r}")
