"""One small exception hierarchy: callers catch `CheckpointError` for anything shardckpt raises on bad input."""
from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error shardckpt raises about a checkpoint or a state dict."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata are damaged: a checksum mismatch, a truncated or missing file, a hostile manifest."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is sound but does not fit what was asked: missing/unexpected keys, shape or dtype mismatch."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no manifest) at the given path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists and `overwrite=True` was not given."""


class StorageError(CheckpointError, OSError):
    """The storage kept failing (after retries, within their deadline) to read or write the named object."""


class StorageConfigError(CheckpointError, ValueError):
    """A URL or storage options the storage backend does not accept: an unknown protocol, no bucket, an option
    it does not know or of the wrong type, credentials that are incomplete."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A state-dict value that shardckpt cannot store (neither a tensor nor a plain JSON-able value)."""


class ShardingError(Exception):
    """Misuse of the sharding runtime: sharding twice, wrong device, a process group that does not match the mesh."""


def key_mismatch(what: str, missing: list, unexpected: list, hint: str = "") -> IncompatibleCheckpointError:
    """The error for keys one side has and the other lacks (the first ten of each are named)."""
    def some(keys: list) -> str:
        return f"{keys[:10]}" + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")

    parts = ([f"missing {some(missing)}"] if missing else []) + ([f"unexpected {some(unexpected)}"] if unexpected else [])
    return IncompatibleCheckpointError(f"{what}: " + "; ".join(parts) + (f". {hint}" if hint else ""))


class BadArgumentError(CheckpointError, ValueError):
    """An argument of a verb function (a ``shardckpt VERB`` option) has a value it cannot take; the message
    names the argument."""
