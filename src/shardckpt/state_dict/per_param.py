"""Which optimizer state entries are per-parameter (Adam's ``exp_avg``) and which are scalars (``step``).

Per-parameter state has its parameter's shape (or, in a runtime-sharded optimizer, the flat shard's)
and is sharded like it; scalars are replicated. Shape alone cannot tell them apart for a 0-d parameter,
whose ``exp_avg`` is 0-d like ``step``: there the same key on other parameters decides, since an
optimizer keeps a key per-parameter for all its parameters or for none.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.sharded_tensor import ShardedTensor


def shaped_like(value: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``value`` is a tensor of exactly ``shape``: the one test of "sharded like its parameter"."""
    return torch.is_tensor(value) and tuple(value.shape) == tuple(shape)


def per_param_keys(entries: Iterable[tuple[tuple[int, ...], dict]]) -> set:
    """The keys some parameter of 1+ dimensions holds with its own shape (or that are ShardedTensors),
    over ``(parameter shape, state entry)`` pairs."""
    keys = set()
    for shape, entry in entries:
        for k, v in entry.items():
            if isinstance(v, ShardedTensor) or (shape and shaped_like(v, shape)):
                keys.add(k)
    return keys


def is_per_param(key: Any, value: Any, shape: tuple[int, ...], keys: set, name: str, strict: bool) -> bool:
    """Whether ``value`` (state ``key`` of the parameter ``name`` of ``shape``) is per-parameter, given the
    ``per_param_keys`` of the whole state. ``strict``: refuse when nothing can tell (every parameter with
    tensor state is 0-d) instead of treating 0-d state as scalars."""
    if not shaped_like(value, shape):
        return False
    if shape or key in keys:
        return True
    if strict and not keys:
        raise IncompatibleCheckpointError(
            f"cannot tell whether optimizer state {key!r} of the 0-d parameter {name!r} is per-parameter or a "
            "scalar like 'step': no parameter of one or more dimensions has optimizer state to compare with. "
            "Convert this optimizer state at its saved type and world size instead")
    return False
