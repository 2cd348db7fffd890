"""Which files of a chunk pool are live, which a collector may delete, and which an incremental save may still
reference (docs/design/incremental.md, "Collection by reachability"). Pure: the callers list the pool, read the
manifests, leases and sweep markers, and act on what these functions return.

A pool file is live while a committed manifest names it, or an in-flight save holds it: on local disk a save
holds every generation directory it writes or references with a shared ``flock`` (``io``'s ``hold_dir``), on object
stores it writes a **lease** naming them before it relies on any. A collector deletes in two steps: the
**candidates** (named by no manifest and no lease, and not fresh), published as a **sweep marker** on object
stores, then, after listing the leases and then the manifests again, the candidates neither names
(``sweep_deletions``). A save drops
every reference a sweep marker names or that no longer exists (``usable_references``). The orderings that make
this safe are proved in the design notes and checked over every interleaving in tests/checkpoint/test_reachability.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from shardckpt.errors import CorruptCheckpointError

_POOL_FILE = re.compile(r"^data-([0-9a-f]{1,64})/[A-Za-z0-9_.-]+$")


def is_pool_file(path: str) -> bool:
    """``data-<generation>/<name>`` (not ``pool.json``, a lease or a sweep marker)."""
    return _POOL_FILE.match(path) is not None


def generation_of(path: str) -> str:
    """The generation that wrote pool file ``data-<generation>/<name>``."""
    match = _POOL_FILE.match(path)
    if match is None:
        raise CorruptCheckpointError(f"{path!r} is not a pool file (data-<generation>/<name>)")
    return match.group(1)


@dataclass(frozen=True)
class ManifestRefs:
    """A committed manifest, as far as collection cares: its checkpoint (the directory below the run directory),
    its own generation, and every pool path its ``files`` name (data files and indexes)."""

    checkpoint: str
    generation: str
    files: frozenset[str]


@dataclass(frozen=True)
class Lease:
    """An in-flight save on an object store: its generation (the files it writes), the checkpoint it will commit,
    the pool files it references, and how long ago it was last written (the store's clock)."""

    generation: str
    target: str
    files: frozenset[str]
    age_s: float


@dataclass(frozen=True)
class SweepMarker:
    """A collector's published candidates (object stores), deleted when its run ends."""

    id: str
    files: frozenset[str]
    age_s: float


@dataclass(frozen=True)
class PoolEntry:
    """A file listed in the pool, with the age of its last write."""

    path: str
    age_s: float


def referenced(manifests: Iterable[ManifestRefs]) -> frozenset[str]:
    return frozenset().union(*(m.files for m in manifests))


def _leased(leases: Iterable[Lease]) -> tuple[frozenset[str], frozenset[str]]:
    """The files the leases reference, and the generations they write."""
    leases = list(leases)
    return frozenset().union(*(lease.files for lease in leases)), frozenset(lease.generation for lease in leases)


def sweep_candidates(pool: Iterable[PoolEntry], manifests: Iterable[ManifestRefs], leases: Iterable[Lease],
                     fresh_s: float) -> frozenset[str]:
    """Pool files no committed manifest and no lease names, not written by a leased save, and at least ``fresh_s``
    old (object stores: a save's files before its lease is visible are protected by age, as debris is today;
    local disk passes 0 and relies on locks)."""
    live = referenced(manifests)
    leased, writing = _leased(leases)
    return frozenset(e.path for e in pool if e.path not in live and e.path not in leased
                     and generation_of(e.path) not in writing and e.age_s >= fresh_s)


def sweep_deletions(candidates: Iterable[str], leases_after_marker: Iterable[Lease],
                    manifests_after_leases: Iterable[ManifestRefs]) -> frozenset[str]:
    """What a collector deletes: its candidates less what the leases listed *after* its marker became visible name,
    less what the manifests listed *after those leases* name. A save whose lease came later sees the marker and does
    not reference them (``usable_references``); one whose lease was gone by then had committed its manifest first."""
    leased, writing = _leased(leases_after_marker)
    live = referenced(manifests_after_leases)
    return frozenset(p for p in candidates if p not in leased and p not in live and generation_of(p) not in writing)


def usable_references(wanted: Iterable[str], markers: Iterable[SweepMarker], existing: Iterable[str]) -> frozenset[str]:
    """The pool files a save may still reference, once its lease (or its locks) is in place: those that exist and
    that no sweep marker names (a collector may be deleting them). The others' chunks are written anew."""
    doomed = frozenset().union(*(m.files for m in markers))
    return frozenset(wanted) & frozenset(existing) - doomed


def redundant_leases(leases: Iterable[Lease], committed: Mapping[str, str]) -> list[Lease]:
    """Leases whose save has committed (``committed``: checkpoint -> generation of its manifest): their manifest now
    protects what they named, so they may go at any age (a save killed right after its commit leaves one)."""
    return [lease for lease in leases if committed.get(lease.target) == lease.generation]


def stale_leases(leases: Iterable[Lease], committed: Mapping[str, str], max_age_s: float) -> list[Lease]:
    """Uncommitted leases not renewed for ``max_age_s``: their save is dead (a live save renews its lease every
    ``max_age_s / 4`` and refuses to commit once ``max_age_s / 2`` have passed since it last did: the one timing
    assumption of the object-store protocol)."""
    return [lease for lease in leases if committed.get(lease.target) != lease.generation and lease.age_s >= max_age_s]


def consolidate(bytes_by_generation: Mapping[str, int], max_generations: int) -> frozenset[str]:
    """The generations whose referenced chunks a save writes anew instead, so that it references at most
    ``max_generations`` (manifest size and per-load file count stay bounded): those it takes the fewest bytes from."""
    if max_generations < 0:
        raise ValueError("max_generations must be >= 0")
    ranked = sorted(bytes_by_generation, key=lambda g: (bytes_by_generation[g], g))
    return frozenset(ranked[:max(0, len(ranked) - max_generations)])


@dataclass(frozen=True)
class SharedFrom:
    """Bytes a checkpoint reads from one generation's files: the checkpoint that wrote them (None: its manifest is
    gone or was replaced) and the other checkpoints that read them too."""

    generation: str
    written_by: str | None
    bytes: int
    also_used_by: tuple[str, ...]


@dataclass(frozen=True)
class SharingReport:
    """What ``verify`` reports: a checkpoint's bytes, those its own save wrote, and those it shares, by origin."""

    checkpoint: str
    total_bytes: int
    own_bytes: int
    shared: tuple[SharedFrom, ...]

    @property
    def shared_bytes(self) -> int:
        return self.total_bytes - self.own_bytes


def sharing(target: ManifestRefs, manifests: Iterable[ManifestRefs], bytes_by_file: Mapping[str, int]) -> SharingReport:
    """``target``'s sharing, from every committed manifest of the pool and the bytes of ``target``'s chunks in each of
    its data files (``bytes_by_file``, summed from its chunk placement)."""
    others = [m for m in manifests if m.checkpoint != target.checkpoint]
    writer = {m.generation: m.checkpoint for m in others}
    by_gen: dict[str, int] = {}
    for path, n in bytes_by_file.items():
        by_gen[generation_of(path)] = by_gen.get(generation_of(path), 0) + n
    shared = []
    for gen in sorted(g for g in by_gen if g != target.generation):
        users = tuple(sorted(m.checkpoint for m in others if any(generation_of(f) == gen for f in m.files)
                             and m.checkpoint != writer.get(gen)))
        shared.append(SharedFrom(gen, writer.get(gen), by_gen[gen], users))
    return SharingReport(target.checkpoint, sum(by_gen.values()), by_gen.get(target.generation, 0), tuple(shared))
