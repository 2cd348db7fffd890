"""shardckpt: distributed checkpoints and state-dict conversion for sharded PyTorch models."""
from __future__ import annotations

from shardckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ShardingError,
    UnsupportedValueError,
)

__version__ = "0.1.0"

from shardckpt.checkpoint.load import load, load_full
from shardckpt.checkpoint.save import save
from shardckpt.regions import Box, FlatRange
from shardckpt.sharded_tensor import ShardedTensor

__all__ = [
    "save", "load", "load_full", "ShardedTensor", "Box", "FlatRange",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompatibleCheckpointError", "ShardingError", "UnsupportedValueError",
]
