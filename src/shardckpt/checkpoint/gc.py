"""Removing what interrupted saves left behind: ``data-<generation>/`` directories no manifest names and
``manifest.json.tmp-*`` files. Nothing committed is touched, nor anything a live writer may still use.

How a live writer is told from debris (``io``'s ``hold_dir`` / ``remove_abandoned``):

- local disk: every rank writing a generation holds a shared ``flock`` on its directory from before its
  first file until the commit is decided; the lock dies with the process. A directory is removed only
  while this module holds an exclusive lock on it, so a writer that was about to start makes it again.
  Where the file system has no locks, nothing is removed. Temporary manifests are held the same way by
  their writer until they have their final name, and an export's directory (``.export-tmp-<token>/``: its
  files until they have their names) until the export ends (``*.export-tmp-*`` files are older versions');
- object stores (no locks): a generation is removed once its newest object is older than
  ``REMOTE_MIN_AGE_S``; a save that has written nothing for that long is taken as dead.

A successful save collects its path's debris after its commit (``collect``), and ``shardckpt gc PATH``
does it on demand; given a run directory (no manifest of its own), for every checkpoint below it too, and it
removes the directories a killed save left empty (``collect_run``).
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from functools import partial

from shardckpt.errors import BadArgumentError, CheckpointError
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.format.pool import POOL_JSON
from shardckpt.io.navigate import child as below
from shardckpt.io import LocalStorage, Storage, lifecycle, open_storage, opened_by_name

log = logging.getLogger("shardckpt")
REMOTE_MIN_AGE_S = 6 * 3600.0
GENERATION_DIR = re.compile(r"^data-[0-9a-f]{1,64}$")
_TEMP_MANIFEST = re.compile(rf"^{re.escape(MANIFEST_NAME)}\.tmp-[0-9a-f]+$")
EXPORT_TEMP = re.compile(r"^.+\.export-tmp-[0-9a-f]+$")  # an older version's export file before its rename
EXPORT_STAGING = re.compile(r"^\.export-tmp-[0-9a-f]+$")  # an export's directory: its files before their renames
STEP_NAME = re.compile(r"step[-_]?\d+", re.IGNORECASE)  # a directory a training loop names for its step


def committed_dir(storage: Storage) -> str | None:
    """The data directory the committed manifest names (None: no checkpoint). Raises ``CheckpointError``
    when a manifest exists but cannot be read: then nothing is known to be uncommitted."""
    if not storage.exists(MANIFEST_NAME):
        return None
    return f"data-{parse_manifest(storage.read_bytes(MANIFEST_NAME), storage.url(MANIFEST_NAME)).generation}"


def committed_entries(storage: Storage) -> set[str]:
    """The entries at the root that the committed manifest uses: its data directory and the first part of every
    path its ``files`` name (a v1 manifest's need not be in ``data-<generation>/``). Empty: no checkpoint.
    Raises ``CheckpointError`` like ``committed_dir``."""
    if not storage.exists(MANIFEST_NAME):
        return set()
    manifest = parse_manifest(storage.read_bytes(MANIFEST_NAME), storage.url(MANIFEST_NAME))
    named = (p for f in manifest.files for p in (f.path, f.index_path))
    return {f"data-{manifest.generation}"} | {p.split("/", 1)[0] for p in named}


def debris(storage: Storage, committed: set[str] | None = None) -> list[str]:
    """The entries at the root that belong to no committed checkpoint now (candidates only: see ``collect``).
    ``committed``: ``committed_entries`` as the caller knows them (a save that just committed), not parsed again."""
    keep = committed_entries(storage) if committed is None else committed
    dirs = [d for d in storage.list_dirs() if GENERATION_DIR.match(d) or EXPORT_STAGING.match(d)]
    files = [f for f in storage.list_files() if _TEMP_MANIFEST.match(f) or EXPORT_TEMP.match(f)]
    return [name for name in dirs + files if name not in keep]


def collect(storage: Storage, dry_run: bool = False, min_age_s: float | None = None, *,
            committed: set[str] | None = None) -> list[str]:
    """Remove (or, ``dry_run``, list) the debris no live writer is using; returns what was removed. Each
    directory is checked against the manifest again once locked: a save may have committed it since
    ``debris`` looked (its writer holds the lock until its manifest is written). ``committed``: as ``debris``'s
    (a stale set only makes a candidate of a newer save's directory, which that check then keeps)."""
    removed = []
    for name in debris(storage, committed):
        age = min_age_s if min_age_s is not None else _min_age(storage, name)
        if lifecycle(storage).remove_abandoned(name, age, dry_run, unused=partial(_not_committed, storage, name)):
            removed.append(name)
            if not dry_run:
                log.info("removed %s (what an interrupted save left)", storage.url(name))
    return removed


def _not_committed(storage: Storage, name: str) -> bool:
    try:
        return name not in committed_entries(storage)
    except CheckpointError:
        return False  # unreadable now: keep everything


def _min_age(storage: Storage, name: str) -> float:
    return 0.0 if isinstance(storage, LocalStorage) else REMOTE_MIN_AGE_S  # local disk goes by locks


def gc(place: str | os.PathLike | Storage, *, dry_run: bool = False, min_age_s: float | None = None) -> list[str]:
    """``shardckpt gc``: remove what interrupted saves left at ``place`` (a local path, or the place opened: see
    the module docstring), and, where it holds no committed checkpoint itself (a run directory), below it
    (``collect_run``); returns the paths removed, relative to ``place``. ``min_age_s`` overrides the age below
    which an entry may still be a live writer's."""
    storage = open_storage(place)
    if not storage.is_dir():
        raise CheckpointError(f"{storage.url('')}: no such directory")
    if storage.exists(POOL_JSON):  # its data-* are named by the run's checkpoints, not by a manifest of its own
        raise BadArgumentError(f"{storage.url('')}: a run's chunk pool (incremental checkpoints); gc the run directory "
                               "above it, which removes the pool's data that no committed checkpoint names")
    removed = collect(storage, dry_run, min_age_s)
    if committed_dir(storage) is None and opened_by_name(storage):
        # opened from a path or URL (io.named): maybe a run directory; a caller's Storage is one checkpoint's place
        removed += collect_run(storage, dry_run=dry_run, min_age_s=min_age_s).removed
    return removed


@dataclass(frozen=True)
class RunCollected:
    """What ``collect_run`` removed (or, dry run, would remove), as paths relative to the run directory
    (``step-000030/data-1f2e``; ``step-000030/``: the directory itself)."""

    removed: list[str]


def collect_run(run_dir: str | os.PathLike | Storage, *, dry_run: bool = False,
                min_age_s: float | None = None) -> RunCollected:
    """The debris of every checkpoint directly below ``run_dir`` (``gc.collect`` on each, with its safety
    rules; a checkpoint: ``is_checkpoint_dir``), then each directory this leaves empty that a save made (named
    for a step, or holding the debris just removed): on local disk, removed only while empty and held by no
    one (``remove_empty_dir``; object stores have no empty directories); then the run's chunk pool, if it has one:
    the files no committed checkpoint names (``pool_gc.sweep_pool``, by reachability)."""
    storage = open_storage(run_dir)
    removed = []
    for name in storage.list_dirs():
        if GENERATION_DIR.match(name) or EXPORT_STAGING.match(name):
            continue
        child = below(storage, name)
        if not is_checkpoint_dir(child, name):
            continue
        try:
            gone = collect(child, dry_run, min_age_s)
        except CheckpointError as e:  # its manifest does not parse: nothing there is known to be debris
            if child.exists(MANIFEST_NAME):  # (else removed meanwhile, by rm: nothing to say)
                warnings.warn(f"{name}: kept as it is ({e})", stacklevel=2)
            continue
        removed += [f"{name}/{g}" for g in gone]
        if not (gone or STEP_NAME.search(name)) or not isinstance(storage, LocalStorage):
            continue
        if dry_run:
            left = set(child.list_dirs()) | set(child.list_files())
            if left <= set(gone):
                removed.append(f"{name}/")
        elif storage.remove_empty_dir(name):
            removed.append(f"{name}/")
    from shardckpt.checkpoint.pool_gc import sweep_pool  # (it imports this module)

    return RunCollected(removed + sweep_pool(storage, dry_run, min_age_s))


def is_checkpoint_dir(storage: Storage, name: str) -> bool:
    """Whether directory ``name`` (at ``storage``) is a checkpoint's, committed or not, so that what ``debris``
    finds in it is a save's: it is named for a step (``step-000050``), or holds a manifest, a temporary
    manifest or an export's temporary files. (Another directory's ``data-2024/`` is not a save's to remove.)"""
    if STEP_NAME.search(name) or storage.exists(MANIFEST_NAME):
        return True
    names = storage.list_files() + storage.list_dirs()
    return any(_TEMP_MANIFEST.match(n) or EXPORT_TEMP.match(n) or EXPORT_STAGING.match(n) for n in names)


