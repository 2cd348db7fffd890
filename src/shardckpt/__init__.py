"""shardckpt: distributed checkpoints and state-dict conversion for sharded PyTorch models.

The names below are imported on first use (PEP 562), so that ``import shardckpt`` and the ``shardckpt``
command's ``--help`` do not import torch (1.7 s); ``_LAZY`` says where each one lives."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardckpt._version import __version__
from shardckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ShardingError,
    StorageConfigError,
    StorageError,
    UnsupportedValueError,
)

_LAZY = {
    "shardckpt.checkpoint.async_save": ("AsyncSaver", "SaveHandle", "async_save"),
    "shardckpt.checkpoint.latest": ("latest_checkpoint",),
    "shardckpt.checkpoint.load": ("load", "load_full"),
    "shardckpt.checkpoint.save": ("save",),
    "shardckpt.regions": ("Box", "FlatRange"),
    "shardckpt.sharded_tensor": ("PerRank", "ShardedTensor"),
    "shardckpt.state_dict": (
        "FullOptimStateDictConfig", "FullStateDictConfig", "LocalOptimStateDictConfig", "LocalStateDictConfig",
        "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "StateDictType",
        "async_save_state", "get_state_dict", "load_state", "rekey_optim_state_dict", "save_state",
        "set_state_dict", "state_dict_type"),
    "shardckpt.state_dict.zero_redundancy": ("load_zero_partition_state", "zero_partition_state"),
    "shardckpt.api": ("convert", "export", "verify", "diff", "inspect", "gc", "latest", "ls"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see; tests/test_package.py checks it matches _LAZY
    from shardckpt.api import convert, diff, export, gc, inspect, latest, ls, verify
    from shardckpt.checkpoint.async_save import AsyncSaver, SaveHandle, async_save
    from shardckpt.checkpoint.latest import latest_checkpoint
    from shardckpt.checkpoint.load import load, load_full
    from shardckpt.checkpoint.save import save
    from shardckpt.regions import Box, FlatRange
    from shardckpt.sharded_tensor import PerRank, ShardedTensor
    from shardckpt.state_dict import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        OptimStateKeyType,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
        async_save_state,
        get_state_dict,
        load_state,
        rekey_optim_state_dict,
        save_state,
        set_state_dict,
        state_dict_type,
    )
    from shardckpt.state_dict.zero_redundancy import load_zero_partition_state, zero_partition_state


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shardckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "save", "async_save", "AsyncSaver", "SaveHandle", "async_save_state", "load", "load_full", "latest_checkpoint", "ShardedTensor", "PerRank", "Box", "FlatRange",
    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "OptimStateKeyType",
    "get_state_dict", "set_state_dict", "state_dict_type", "save_state", "load_state", "rekey_optim_state_dict",
    "zero_partition_state", "load_zero_partition_state",
    "convert", "export", "verify", "diff", "inspect", "gc", "latest", "ls",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompatibleCheckpointError", "ShardingError", "StorageConfigError", "StorageError", "UnsupportedValueError",
]
