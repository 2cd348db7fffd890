"""``TierConfig``: where each tier lives, how often it is written, how much it may hold. Frozen, checked on
construction (a bad value raises ``TierConfigError`` naming the field), importable without torch."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from shardckpt.errors import CheckpointError
from shardckpt.sizes import parse_size
from shardckpt.storage_options import StorageOptions

_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
ON_FULL = ("skip", "raise")
MAX_TIMEOUT_S = 1e9  # a socket's timeout is a C time_t in microseconds: infinity overflows it
RESERVED_NODE = "<persistent>"  # tiers.peers.PERSISTENT: the name of tier 2 where a node's is expected
VERIFY = ("as-read", "before-choosing")


class TierConfigError(CheckpointError, ValueError):
    """A ``TierConfig`` field has a value it cannot take; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """The settings of a ``CheckpointManager`` with tiers (docs/design/tiers.md).

    ``local_dir``: tier 0's root on every node (``/dev/shm/shardckpt``, or an NVMe directory), the same path on
    every node; checkpoints go below ``local_dir/run_id/step-NNNNNNNNN/``. ``run_id`` keeps jobs that share a
    node apart (path-safe: letters, digits, ``_.-``).
    ``persistent_dir``: tier 2 (a path or fsspec URL), or None for none; its steps are ``step-NNNNNNNNN/``
    below it, each a plain shardckpt checkpoint. ``persistent_options``: how tier 2's store is opened, as every
    verb's ``storage_options`` (a ``StorageOptions``, or fsspec's keyword arguments as a dict, e.g.
    ``{"endpoint_url": ...}`` for an S3-compatible store); None: the store's defaults.
    ``local_every`` / ``persistent_every``: save to tier 0 every so many steps, and to tier 2 every so many (a
    multiple of ``local_every``: tier 2 is uploaded from tier 0's copy, so every persisted step is a tier-0 step).
    ``replicas``: the number ``k`` of peer nodes that hold a copy of each node's files (0: none; at most the
    number of nodes less one, checked when the nodes are known).
    ``keep_last``: tier-0 steps each node keeps (replicas with their step); ``persistent_keep_last``: tier-2 steps
    kept (None: all).
    ``local_budget``: bytes tier 0 may hold on one node (int or ``"24GiB"``); None: only the free-space rule.
    ``min_free``: memory (for a tmpfs ``local_dir``) or disk space left to the node after tier 0's next step;
    a step that would leave less is handled by ``on_full``: ``"skip"`` (that step gets no tier-0 copy; the
    previous ones stay; a warning says why and what to change) or ``"raise"`` (``TierFullError`` on every rank).
    ``node_id``: this node's name; None: the ``SHARDCKPT_NODE_ID`` environment variable, else the host name.
    ``failure_domain``: this node's rack or switch (None: the node is its own); replicas go to other domains first.
    ``verify``: a restore checks every byte it reads against its checksums in any case; ``"before-choosing"``
    also reads every local copy whole before the step is chosen (slower; for media that corrupt silently).
    ``peer_host`` / ``peer_port``: where this node serves its tier 0, read-only, to its peers (replication and
    restores read it as a ``Storage``); None: the address of this node's interface towards ``MASTER_ADDR`` (the
    route the job's rendezvous takes), 127.0.0.1 without one; port 0: one the OS picks. A port in use raises
    ``TierConfigError``.
    ``peer_timeout_s``: how long a read from a peer may stall before that copy counts as unreachable.
    ``keep_local_on_close``: leave tier 0 in place when the manager closes normally (by default it is removed once
    the last due step is in tier 2: a tmpfs holds the node's memory until someone does).
    """

    local_dir: str
    run_id: str
    persistent_dir: str | None = None
    persistent_options: Any = None
    local_every: int = 1
    persistent_every: int | None = None
    replicas: int = 1
    keep_last: int = 2
    persistent_keep_last: int | None = None
    local_budget: int | str | None = None
    min_free: int | str = "1GiB"
    on_full: str = "skip"
    node_id: str | None = None
    failure_domain: str | None = None
    verify: str = "as-read"
    peer_host: str | None = None
    peer_port: int = 0
    peer_timeout_s: float = 60.0
    keep_local_on_close: bool = False

    def __post_init__(self) -> None:
        _text("local_dir", self.local_dir)
        if not _RUN_ID.match(self.run_id if isinstance(self.run_id, str) else ""):
            raise TierConfigError(f"run_id {self.run_id!r}: 1-128 letters, digits, '_', '.' or '-' (it names a "
                                  "directory below local_dir)")
        if self.persistent_dir is not None:
            _text("persistent_dir", self.persistent_dir)
        _options(self.persistent_options, self.persistent_dir)
        _positive("local_every", self.local_every)
        if self.persistent_every is not None:
            _positive("persistent_every", self.persistent_every)
            if self.persistent_every % self.local_every:
                raise TierConfigError(f"persistent_every ({self.persistent_every}) must be a multiple of local_every "
                                      f"({self.local_every}): tier 2 is uploaded from tier 0's copy of a step")
            if self.persistent_dir is None:
                raise TierConfigError("persistent_every is set but persistent_dir is None: say where tier 2 lives")
        _count("replicas", self.replicas, 0)
        _count("keep_last", self.keep_last, 1)
        if self.persistent_keep_last is not None:
            _count("persistent_keep_last", self.persistent_keep_last, 1)
        if self.local_budget is not None:
            object.__setattr__(self, "local_budget", _size("local_budget", self.local_budget))
        object.__setattr__(self, "min_free", _size("min_free", self.min_free))
        _choice("on_full", self.on_full, ON_FULL)
        _choice("verify", self.verify, VERIFY)
        if not isinstance(self.peer_port, int) or isinstance(self.peer_port, bool) or not 0 <= self.peer_port <= 65535:
            raise TierConfigError(f"peer_port {self.peer_port!r}: expected an int in 0..65535")
        if not isinstance(self.peer_timeout_s, (int, float)) or isinstance(self.peer_timeout_s, bool) or \
                not 0 < self.peer_timeout_s < MAX_TIMEOUT_S:
            raise TierConfigError(f"peer_timeout_s {self.peer_timeout_s!r}: expected a number of seconds > 0 and "
                                  f"< {MAX_TIMEOUT_S:.0f} (a socket timeout)")
        if not isinstance(self.keep_local_on_close, bool):
            raise TierConfigError(f"keep_local_on_close {self.keep_local_on_close!r}: expected True or False")
        for name in ("node_id", "failure_domain", "peer_host"):
            value = getattr(self, name)
            if value is not None:
                _text(name, value)
        if self.node_id == RESERVED_NODE:
            raise TierConfigError(f"node_id {self.node_id!r}: reserved (it names tier 2 where a node is expected)")

    def persistent_storage(self, name: str = ""):
        """Tier 2 (``persistent_dir``), or its child directory ``name``, opened with ``persistent_options``."""
        from shardckpt.io import open_storage  # (this module stays importable without the I/O layer)

        base = self.persistent_dir
        url = base if not name else f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)
        return open_storage(url, self.persistent_options)

    def persists(self, step: int) -> bool:
        """Whether ``step`` goes to tier 2 (as well as to tier 0)."""
        return self.persistent_every is not None and step % self.persistent_every == 0

    def saves_locally(self, step: int) -> bool:
        """Whether ``step`` goes to tier 0."""
        return step % self.local_every == 0

    def replace(self, **changes) -> TierConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise TierConfigError(f"{name} {value!r}: expected a non-empty string")


def _positive(name: str, value: object) -> None:
    _count(name, value, 1)


def _count(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise TierConfigError(f"{name} {value!r}: expected an int >= {least}")


def _size(name: str, value: object) -> int:
    try:
        return parse_size(value)  # type: ignore[arg-type]
    except ValueError as e:
        raise TierConfigError(f"{name}: {e}") from None


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TierConfigError(f"{name} {value!r}: expected one of {', '.join(map(repr, choices))}")


def _options(options: Any, persistent_dir: str | None) -> None:
    if options is None:
        return
    if not isinstance(options, (dict, StorageOptions)):
        raise TierConfigError(f"persistent_options {options!r}: expected a StorageOptions or a dict of fsspec's options")
    if persistent_dir is None:
        raise TierConfigError("persistent_options: given without a persistent_dir to open with them")
