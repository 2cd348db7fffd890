"""Which checkpoints of a run a retention policy keeps (``keep_last=N, keep_every=M``; docs/design/incremental.md).
Pure: the caller lists the run directory's committed checkpoints and removes the others with ``rm``, which never
breaks a kept one (their pooled data is collected by reachability, not with the checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from shardckpt.errors import BadArgumentError


@dataclass(frozen=True)
class Retention:
    """``keep_last``: the N highest steps (None: all). ``keep_every``: also every step that is a multiple of M (None:
    none besides). A checkpoint without a step in its name is never removed by a policy."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BadArgumentError(f"{name} must be an int >= 1 or None, got {value!r}")


def steps_to_keep(steps: Iterable[int], policy: Retention, protect: Iterable[int] = ()) -> frozenset[int]:
    """The steps ``policy`` keeps among the committed ``steps``. ``protect``: kept whatever the policy says (the step
    a save just committed: re-saving an older step after a rollback must not remove it at once)."""
    steps = frozenset(steps)
    if policy.keep_last is None:
        return steps
    keep = set(sorted(steps)[-policy.keep_last:])
    if policy.keep_every is not None:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    return frozenset(keep | (set(protect) & steps))


def steps_to_remove(steps: Iterable[int], policy: Retention, protect: Iterable[int] = ()) -> list[int]:
    """The committed steps ``policy`` removes, oldest first (so a kill midway leaves the newest ones)."""
    steps = frozenset(steps)
    return sorted(steps - steps_to_keep(steps, policy, protect))
