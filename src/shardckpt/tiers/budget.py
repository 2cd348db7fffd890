"""What tier 0 may hold on one node, pure: the room left for the next step, which old steps to evict first, and
the refusal (with what to change) when even that is not enough. The executor measures (``statvfs`` of the tier-0
directory, ``MemAvailable`` from ``/proc/meminfo`` when it is a tmpfs) and asks here.

Why both numbers on a tmpfs: its pages are memory, and its size limit need not fit in memory (this machine's
``/dev/shm`` may grow to all 24 GiB of RAM, as much as ``statvfs`` reports free, while the training ranks use
part of that RAM). Writing a tmpfs past ``MemAvailable`` makes the kernel swap or kill a process, which is the
one outcome worse than a step without a fast copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from shardckpt.errors import CheckpointError
from shardckpt.sizes import format_bytes


class TierFullError(CheckpointError):
    """Tier 0 has no room for a step (``on_full="raise"``); the message says how much was needed and what to change."""


@dataclass(frozen=True)
class Space:
    """What the executor measured at ``path``: ``fs_free`` (``statvfs``: ``f_bavail * f_frsize``) and, for a tmpfs,
    ``mem_available`` (``MemAvailable``; None on a disk, whose pages the kernel may drop)."""

    path: str
    fs_free: int
    mem_available: int | None = None


def incoming(rank_bytes: Mapping[int, int], node_ranks: Mapping[str, Sequence[int]],
             peers: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Bytes each node's tier 0 takes for one step: its own ranks' files and the replicas it holds for the nodes
    whose peers include it (``rank_bytes``: each rank's data and index bytes, from the save plan)."""
    own = {node: sum(rank_bytes[r] for r in ranks) for node, ranks in node_ranks.items()}
    out = dict(own)
    for owner, holders in peers.items():
        for holder in holders:
            out[holder] += own[owner]
    return out


def room(space: Space, min_free: int) -> int:
    """Bytes tier 0 may add at ``space`` and still leave ``min_free`` to the node (never negative)."""
    free = space.fs_free if space.mem_available is None else min(space.fs_free, space.mem_available)
    return max(0, free - min_free)


@dataclass(frozen=True)
class HeldStep:
    """A step in this node's tier 0: its order key ``(epoch, step)``, its bytes (own files and replicas), whether it
    is ``pinned`` (being replicated, uploaded to tier 2, or read by a restore: it stays until released) and whether
    it is ``safe``: complete with its replicas (the newest safe step is kept until a newer one is safe)."""

    key: tuple[int, int]
    nbytes: int
    pinned: bool = False
    safe: bool = True


@dataclass(frozen=True)
class RoomPlan:
    """``evict``: the keys to remove before writing (oldest first); ``fits``: whether the step then fits;
    ``message``: why not, and what to change (empty when it fits)."""

    evict: tuple[tuple[int, int], ...]
    fits: bool
    message: str = ""


def plan_room(held: Sequence[HeldStep], incoming: int, space: Space, min_free: int,
              budget: int | None = None) -> RoomPlan:
    """Before writing a step of ``incoming`` bytes on this node: evict the oldest evictable steps (not pinned, and
    not the newest safe one, the copy a restore falls back on while the new step is written) until it fits within
    the room ``space`` leaves and the ``budget``; or say it does not fit."""
    used = sum(s.nbytes for s in held)
    limit = room(space, min_free)

    def fits(freed: int) -> bool:
        within_budget = budget is None or used - freed + incoming <= budget
        return within_budget and incoming <= limit + freed

    newest_safe = max((s.key for s in held if s.safe), default=None)
    evictable = sorted((s for s in held if not s.pinned and s.key != newest_safe), key=lambda s: s.key)
    evict, freed = [], 0
    for step in evictable:
        if fits(freed):
            break
        evict.append(step.key)
        freed += step.nbytes
    if fits(freed):
        return RoomPlan(tuple(evict), True)
    kept = used - freed
    return RoomPlan((), False, _refusal(incoming, space, min_free, budget, kept, limit + freed))


def trim(held: Sequence[HeldStep], keep_last: int) -> tuple[tuple[int, int], ...]:
    """After a step is committed (and replicated): the keys beyond the newest ``keep_last`` to remove now, oldest
    first. Pinned steps wait for their release, and the newest safe step is never among them."""
    newest_safe = max((s.key for s in held if s.safe), default=None)
    ordered = sorted(held, key=lambda s: s.key, reverse=True)
    return tuple(sorted(s.key for s in ordered[keep_last:] if not s.pinned and s.key != newest_safe))


def _refusal(incoming: int, space: Space, min_free: int, budget: int | None, kept: int, free: int) -> str:
    limits = [f"{format_bytes(free)} free at {space.path} after leaving min_free={format_bytes(min_free)} to the node"]
    if space.mem_available is not None:
        limits[0] += f" (a tmpfs: counted against MemAvailable, {format_bytes(space.mem_available)})"
    if budget is not None:
        limits.append(f"local_budget={format_bytes(budget)} with {format_bytes(kept)} held by steps that must stay")
    return (f"tier 0 has no room for this step: it needs {format_bytes(incoming)} on this node (its ranks' files and "
            f"the replicas it receives), and there is {'; '.join(limits)}. Lower keep_last or replicas, raise "
            "local_budget, or point local_dir at a larger disk")
