"""How a place named by a URL is opened: the fsspec backend's own keyword arguments, untouched, and shardckpt's
tuning of its I/O, typed (``StorageTuning``). Light and at the base: the command line builds a
``StorageOptions`` from its ``--storage-option KEY=VALUE`` pairs (``options.STORAGE``), ``io.open_storage`` opens
a place with one, and nothing in between looks inside.

Until 0.6 shardckpt's own keys travelled in the fsspec dict and ``io`` popped them out. A plain dict with
``retry_deadline_s`` or ``connect_deadline_s`` still works for one release, with a ``DeprecationWarning`` naming
the typed replacement (``as_storage_options``); the command line's ``-o retry_deadline_s=...`` is translated at
the edge and stays.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from shardckpt.errors import StorageConfigError

RETRY_DEADLINE_S = 120.0
CONNECT_DEADLINE_S = 3.0
TUNING_KEYS = ("retry_deadline_s", "connect_deadline_s")  # shardckpt's, never fsspec's


@dataclass(frozen=True, kw_only=True)
class StorageTuning:
    """shardckpt's I/O tuning of an object store (S3 today; other places ignore it).

    ``part_size``: bytes per multipart part and per ranged GET (None: s3fs's ``default_block_size`` if given in the
    fsspec options, else 8 MiB); ``concurrency``: parts in flight per file and streams per load (None: s3fs's
    ``max_concurrency`` if given, else 8); ``retry_deadline_s``: how long one request is retried (throttling,
    5xx, timeouts, resets); ``connect_deadline_s``: how long it is retried while the endpoint cannot be reached
    at all (refused, unknown host), at most ``retry_deadline_s``."""

    part_size: int | None = None
    concurrency: int | None = None
    retry_deadline_s: float = RETRY_DEADLINE_S
    connect_deadline_s: float = CONNECT_DEADLINE_S

    def __post_init__(self) -> None:
        for name in ("part_size", "concurrency"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive(name, getattr(self, name), int))
        for name in TUNING_KEYS:
            object.__setattr__(self, name, positive(name, getattr(self, name), float))


@dataclass(frozen=True)
class StorageOptions:
    """``fsspec``: the backend's keyword arguments (``endpoint_url``, ``anon``, ``client_kwargs``, ...), passed on
    as they are; ``tuning``: shardckpt's own."""

    fsspec: Mapping[str, Any] = field(default_factory=dict)
    tuning: StorageTuning = field(default_factory=StorageTuning)

    def __post_init__(self) -> None:
        if not isinstance(self.fsspec, Mapping):
            raise StorageConfigError(f"StorageOptions.fsspec: expected a dict of fsspec options, got {self.fsspec!r}")
        if not isinstance(self.tuning, StorageTuning):
            raise StorageConfigError(f"StorageOptions.tuning: expected a StorageTuning, got {self.tuning!r}")

    def __bool__(self) -> bool:
        return bool(self.fsspec) or self.tuning != StorageTuning()


Options = StorageOptions | dict  # what ``storage_options=`` takes (``as_storage_options``)


def positive(name: str, value: Any, kind: type) -> Any:
    """A positive, finite number (``int``: a whole one; bools and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (kind is int and value != int(value)):
        what = "a positive integer" if kind is int else "a positive number of seconds"
        raise StorageConfigError(f"storage option {name}: expected {what}, got {value!r}")
    return kind(value)


def split_tuning(options: Mapping[str, Any]) -> StorageOptions:
    """A flat dict of options, shardckpt's keys (``TUNING_KEYS``) among fsspec's, as ``StorageOptions``: what the
    command line's ``--storage-option`` pairs make, with no warning (the flags are the command line's)."""
    fsspec = {k: v for k, v in options.items() if k not in TUNING_KEYS}
    return StorageOptions(fsspec, StorageTuning(**{k: options[k] for k in TUNING_KEYS if k in options}))


def as_storage_options(value: StorageOptions | Mapping[str, Any] | None) -> StorageOptions:
    """What a public function's ``storage_options=`` was given, as ``StorageOptions``: a ``StorageOptions`` as it
    is, a dict as fsspec's options. A dict that still holds shardckpt's own keys works for this release with a
    ``DeprecationWarning`` that names the typed replacement."""
    if value is None:
        return StorageOptions()
    if isinstance(value, StorageOptions):
        return value
    if not isinstance(value, Mapping):
        raise StorageConfigError(f"storage_options: expected a dict of fsspec options or a StorageOptions, "
                                 f"got {value!r}")
    ours = [k for k in TUNING_KEYS if k in value]
    if ours:
        given = ", ".join(f"{k}={value[k]!r}" for k in ours)
        warnings.warn(f"storage_options {ours} are shardckpt's, not fsspec's: pass storage_options="
                      f"StorageOptions(fsspec={{...}}, tuning=StorageTuning({given})) (shardckpt.StorageOptions, "
                      f"shardckpt.StorageTuning); the plain dict keys go in the next release",
                      DeprecationWarning, stacklevel=3)
    return split_tuning(value)
