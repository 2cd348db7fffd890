"""The object-store side of collection by reachability: leases and sweep markers (docs/design/incremental.md, 6.3).

Object stores have no locks, so a save and a collector publish what they are about to rely on or delete:

- a save (rank 0) PUTs ``shardckpt-pool/leases/<generation>.json`` (the checkpoint it will commit, its generation,
  every pool file it may reference) *before* it checks which references exist, drops those any sweep marker names,
  renews the lease every ``T/4`` while it runs, refuses to commit once ``T/2`` has passed since it last did, and
  DELETEs it after its commit (``SaveLease``);
- a collector deletes the leases that are redundant (committed) or stale (not renewed for ``T``), lists the leases,
  then the manifests and the pool: the candidates (``reachability.sweep_candidates``); PUTs them as
  ``shardckpt-pool/sweeps/<id>.json``; lists the leases, *then* the manifests, again: it deletes the candidates
  neither names (``reachability.sweep_deletions``), stopping if ``T/2`` passes; then DELETEs its marker
  (``sweep_object_store``).

``T`` (``LEASE_T_S``, 6 h) is the one timing assumption: no save or collector stalls that long between two of its
steps. The orderings are model-checked (every interleaving, kills included) in tests/checkpoint/test_reachability.py;
the proof is in the design notes. A lease or marker that does not parse stops the collector (what it protects is
unknown) and makes a save reference nothing (it writes every chunk anew).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Iterable

from shardckpt.checkpoint.reachability import (
    Lease, PoolEntry, SweepMarker, is_pool_file, redundant_leases, stale_leases, sweep_candidates, sweep_deletions,
)
from shardckpt.errors import CheckpointError
from shardckpt.io import LocalStorage, Storage

log = logging.getLogger("shardckpt")

LEASE_T_S = 6 * 3600.0  # T: a live save renews its lease 4 times in T; a lease older than T is a dead save's
LEASES_DIR = "leases"
SWEEPS_DIR = "sweeps"


class SaveLease:
    """An in-flight save's lease in ``pool`` (object stores), renewed in a thread until ``release``."""

    def __init__(self, pool: Storage, generation: str, target: str, files: Iterable[str]):
        self.pool, self.path = pool, f"{LEASES_DIR}/{generation}.json"
        self._data = json.dumps({"target": target, "generation": generation, "files": sorted(files)}).encode()
        self._stop = threading.Event()
        self.pool.put_atomic(self.path, self._data)
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._renew, name="shardckpt-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_T_S / 4):
            try:
                self.pool.put_atomic(self.path, self._data)
                self._renewed = time.monotonic()
            except OSError as e:  # the next try may work; past T/2 the save refuses to commit
                log.warning("%s: renewing the save's lease failed: %s", self.pool.url(self.path), e)

    def check_fresh(self) -> None:
        """Raise unless the lease was renewed less than ``T/2`` ago: a collector may take it for a dead save's
        soon, and delete what this save references."""
        since = time.monotonic() - self._renewed
        if since >= LEASE_T_S / 2:
            raise CheckpointError(f"{self.pool.url(self.path)}: this save's lease was last renewed {since:.0f} s ago "
                                  f"(more than {LEASE_T_S / 2:.0f} s): a collector may be removing what it references; "
                                  "nothing was committed")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        remove_file(self.pool, self.path)


def remove_file(storage: Storage, path: str) -> None:
    """Delete one file (a missing one is not an error): ``unlink`` on local disk, one DELETE on object stores."""
    if isinstance(storage, LocalStorage):
        try:
            os.unlink(storage.url(path))
        except FileNotFoundError:
            pass
        return
    try:
        storage.fs.rm_file(storage.url(path))
    except FileNotFoundError:
        pass


def read_leases(pool: Storage) -> list[Lease]:
    """The pool's leases, with their ages (raises ``CheckpointError`` for one that does not parse)."""
    out = []
    for name, (_, age) in pool.listing(LEASES_DIR).items():
        data = _read_json(pool, f"{LEASES_DIR}/{name}")
        if data is None:
            continue  # deleted since the listing: its save committed or ended
        try:
            out.append(Lease(str(data["generation"]), str(data["target"]), frozenset(map(str, data["files"])), age))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{pool.url(f'{LEASES_DIR}/{name}')}: not a lease ({e!r})") from None
    return out


def read_markers(pool: Storage) -> list[SweepMarker]:
    """The pool's sweep markers, with their ages (raises ``CheckpointError`` for one that does not parse)."""
    out = []
    for name, (_, age) in pool.listing(SWEEPS_DIR).items():
        data = _read_json(pool, f"{SWEEPS_DIR}/{name}")
        if data is None:
            continue
        try:
            out.append(SweepMarker(name, frozenset(map(str, data["files"])), age))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{pool.url(f'{SWEEPS_DIR}/{name}')}: not a sweep marker ({e!r})") from None
    return out


def _read_json(pool: Storage, path: str) -> dict | None:
    if not pool.exists(path):
        return None
    try:
        data = json.loads(pool.read_bytes(path))
    except ValueError as e:
        raise CheckpointError(f"{pool.url(path)}: not JSON ({e})") from None
    except CheckpointError:
        if pool.exists(path):
            raise
        return None
    if not isinstance(data, dict):
        raise CheckpointError(f"{pool.url(path)}: not a JSON object")
    return data


def sweep_object_store(pool: Storage, list_manifests, fresh_s: float, dry_run: bool = False) -> list[str]:
    """Delete (``dry_run``: list) the pool files of ``pool`` (an object store) that no committed manifest and no live
    save names and that are at least ``fresh_s`` old; ``list_manifests()`` lists the run's committed manifests of
    this pool as ``ManifestRefs`` (strictly: one that does not parse raises, and nothing is deleted). Returns the
    files' paths relative to the pool."""
    for marker in read_markers(pool):
        if marker.age_s >= LEASE_T_S and not dry_run:  # a killed collector's: it only costs savers their dedup
            remove_file(pool, f"{SWEEPS_DIR}/{marker.id}")
    leases = read_leases(pool)
    manifests = list(list_manifests())
    committed = {m.checkpoint: m.generation for m in manifests}
    gone = redundant_leases(leases, committed) + stale_leases(leases, committed, LEASE_T_S)
    if not dry_run:
        for lease in gone:
            remove_file(pool, f"{LEASES_DIR}/{lease.generation}.json")
    leases = [lease for lease in leases if lease not in gone]
    entries = [PoolEntry(path, age) for path, (_, age) in pool.listing("").items() if is_pool_file(path)]
    candidates = sweep_candidates(entries, manifests, leases, fresh_s)
    if dry_run or not candidates:
        return sorted(candidates)
    marker = f"{SWEEPS_DIR}/{uuid.uuid4().hex}.json"
    pool.put_atomic(marker, json.dumps({"files": sorted(candidates)}).encode())
    published = time.monotonic()
    removed = []
    try:
        leases = read_leases(pool)  # the leases, *then* the manifests (the proof needs this order)
        deletions = sweep_deletions(candidates, leases, list(list_manifests()))
        for path in sorted(deletions):
            if time.monotonic() - published >= LEASE_T_S / 2:
                log.warning("%s: the sweep ran past %.0f s; the rest is left to the next gc", pool.url(""),
                            LEASE_T_S / 2)
                break
            remove_file(pool, path)
            log.info("removed %s (no committed checkpoint names it)", pool.url(path))
            removed.append(path)
    finally:
        remove_file(pool, marker)
    return removed

