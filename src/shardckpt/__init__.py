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
