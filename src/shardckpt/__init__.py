"""shardckpt: distributed checkpoints and state-dict conversion for sharded PyTorch models."""
from __future__ import annotations

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

__all__ = [
    "save", "async_save", "AsyncSaver", "SaveHandle", "async_save_state", "load", "load_full", "latest_checkpoint", "ShardedTensor", "PerRank", "Box", "FlatRange",
    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "OptimStateKeyType",
    "get_state_dict", "set_state_dict", "state_dict_type", "save_state", "load_state", "rekey_optim_state_dict",
    "zero_partition_state", "load_zero_partition_state",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompatibleCheckpointError", "ShardingError", "StorageConfigError", "StorageError", "UnsupportedValueError",
]
