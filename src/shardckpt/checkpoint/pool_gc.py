"""Collection by reachability (docs/design/incremental.md, 6): a pool file is deleted only when no committed
manifest of the run directory names it; ``rm`` removes a checkpoint by deleting its manifest (its pooled data
goes by reachability), and retention (``keep_last`` / ``keep_every``) is ``rm`` of the steps a policy drops.

Local disk (``flock``s, model-checked in tests/checkpoint/test_reachability.py): a saver holds, shared, every
generation it references or writes before it checks that the files exist and until its commit is decided
(``checkpoint.incremental``). The collector here:

1. takes an exclusive, non-blocking lock on each generation directory of the pool (skips the held ones: a save
   uses them);
2. then lists and parses every committed manifest of the run directory with the pool's id;
3. deletes the locked generations' files that no manifest names (and a directory left empty);
4. lets go.

Object stores have no locks: there savers publish leases and the collector sweep markers (``pool_leases``), and a
file unnamed for less than ``min_age_s`` (default 6 h) is kept.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from shardckpt.checkpoint.gc import GENERATION_DIR
from shardckpt.checkpoint.latest import child_dirs, latest_checkpoint, step_of
from shardckpt.checkpoint.pool import manifest_refs, pool_checkpoints, referenced_files, run_storage
from shardckpt.checkpoint.pool_leases import LEASE_T_S, remove_file, sweep_object_store
from shardckpt.checkpoint.reachability import ManifestRefs
from shardckpt.checkpoint.retention import Retention, steps_to_remove
from shardckpt.errors import CheckpointError, CheckpointNotFoundError
from shardckpt.format.manifest import MANIFEST_NAME, POOL_DIR, parse_manifest
from shardckpt.formats.native.pool import read_pool_info
from shardckpt.io import LocalStorage, Storage, lifecycle, open_storage, where
from shardckpt.io.navigate import child, name_of

log = logging.getLogger("shardckpt")


def sweep_pool(run: Storage, dry_run: bool = False, min_age_s: float | None = None) -> list[str]:
    """Delete (or, ``dry_run``, list) the pool files of run directory ``run`` that no committed checkpoint names and
    no live save holds; returns their paths relative to the run directory (``shardckpt-pool/data-<g>/<file>``).
    ``min_age_s``: object stores only, keep files written more recently (default ``pool_leases.LEASE_T_S``)."""
    pool = child(run, POOL_DIR)
    info = read_pool_info(pool)
    if info is None:
        return []
    if not isinstance(pool, LocalStorage):
        def manifests() -> list[ManifestRefs]:
            return [manifest_refs(c.name, c.manifest) for c in pool_checkpoints(run, None)]

        fresh_s = LEASE_T_S if min_age_s is None else min_age_s
        return [f"{POOL_DIR}/{p}" for p in sweep_object_store(pool, manifests, fresh_s, dry_run)]
    locked = []
    try:
        for name in pool.list_dirs(""):
            if GENERATION_DIR.match(name):
                try:
                    locked.append((name, lifecycle(pool).hold_dir(name, exclusive=True)))
                except CheckpointError:
                    continue  # a live save holds it
        named = referenced_files([c.manifest for c in pool_checkpoints(run, None)])  # after the locks
        return _delete_unnamed(pool, [name for name, _ in locked], named, dry_run)
    finally:
        for _, hold in locked:
            hold.release()


def _delete_unnamed(pool: Storage, generations: list[str], named: set[str], dry_run: bool) -> list[str]:
    removed = []
    for gen in generations:
        files = pool.list_files(gen)
        doomed = [f"{gen}/{f}" for f in files if f"{gen}/{f}" not in named]
        for path in doomed:
            if not dry_run:
                remove_file(pool, path)
                log.info("removed %s (no committed checkpoint names it)", pool.url(path))
            removed.append(f"{POOL_DIR}/{path}")
        if not dry_run and len(doomed) == len(files):
            try:
                os.rmdir(pool.url(gen))
            except OSError:
                pass
    if not dry_run and removed:
        lifecycle(pool).sync_dir("")
    return removed


def rm(place: str | os.PathLike | Storage, *, force: bool = False) -> str:
    """Remove the checkpoint at ``place`` (a local path, or the place opened): its manifest is deleted first, in
    one atomic step (the commit point of the removal), then what is left of its directory. A pooled checkpoint's
    data stays in the pool until ``gc`` finds no committed checkpoint naming it, so removing one never breaks
    another. Without ``force``, the run's latest committed checkpoint is refused. Returns the removed checkpoint as
    given (``io.where``)."""
    given = open_storage(place)
    local = isinstance(given, LocalStorage)
    # A link: its target goes.
    step = LocalStorage(os.path.realpath(given.root), given.direct_io, given.durable) if local else given
    if not step.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(f"{step.url(MANIFEST_NAME)}: no committed checkpoint here to remove")
    manifest = parse_manifest(step.read_bytes(MANIFEST_NAME), step.url(MANIFEST_NAME))
    run = run_storage(step)
    name = name_of(step)
    if not force and (_latest_through_links(given.root) if local else _is_latest(run, name)):
        raise CheckpointError(f"{where(given)}: the run's latest committed checkpoint; pass force=True to remove "
                              "it")
    below = [d for d in child_dirs(step) if d == POOL_DIR or step.exists(f"{d}/{MANIFEST_NAME}")]
    if not force and below:
        raise CheckpointError(f"{where(given)}: holds checkpoints of its own below it ({', '.join(below[:3])}"
                              f"{', ...' if len(below) > 3 else ''}), which removing it would remove too; remove them "
                              "one by one, or pass force=True")
    remove_checkpoint(run, name)
    log.info("removed %s (format v%d%s)", where(given), manifest.version, ", pooled" if manifest.pool else "")
    return where(given)


def remove_checkpoint(run: Storage, name: str) -> None:
    """Delete ``name``'s manifest (local: ``unlink``, then the directory made durable), then its directory."""
    step = child(run, name)
    remove_file(step, MANIFEST_NAME)
    if isinstance(step, LocalStorage):
        try:
            step.sync_dir("")
        except FileNotFoundError:  # a concurrent gc of the run removed the emptied directory: removed all the same
            return
    run.remove_dir(name)


def _latest_through_links(path: str | os.PathLike) -> bool:
    """Whether local ``path`` is, or links to, the latest committed checkpoint of the run it is named in
    (``latest_checkpoint``, which counts linked step directories): ``RUN/latest -> step-000002`` is the latest."""
    latest = latest_checkpoint(os.path.dirname(os.path.abspath(path).rstrip(os.sep)))
    return latest is not None and os.path.realpath(latest) == os.path.realpath(path)


def _is_latest(run: Storage, name: str) -> bool:
    steps = [(step_of(n), n) for n in child_dirs(run) if step_of(n) is not None and run.exists(f"{n}/{MANIFEST_NAME}")]
    return bool(steps) and max(steps)[1] == name


def apply_retention(run: Storage, pool_id: str, policy: Retention, protect: str) -> list[str]:
    """Remove the pooled checkpoints of ``run`` that ``policy`` drops, oldest first (``protect``: the checkpoint a
    save just committed), then sweep the pool; returns the names removed."""
    by_step: dict[int, list[str]] = {}
    for c in pool_checkpoints(run, pool_id, strict=False):
        if step_of(c.name) is not None:
            by_step.setdefault(step_of(c.name), []).append(c.name)
    protected = [step_of(protect)] if step_of(protect) is not None else []
    removed = []
    for step in steps_to_remove(by_step, policy, protected):
        for name in by_step[step]:
            if name != protect:
                remove_checkpoint(run, name)
                removed.append(name)
    return removed


def tidy_after_save(step: Storage, pool_id: str, policy: Retention | None, replaced: bool = False) -> Any:
    """A pooled save's tidy-up on rank 0 after its commit: retention, then a sweep where something may have become
    unnamed (``sweep_due``). Failures are logged, never raised: the save is committed."""
    try:
        run = run_storage(step)
        name = name_of(step)
        if policy is not None:
            apply_retention(run, pool_id, policy, name)
        if policy is not None or (isinstance(step, LocalStorage) and sweep_due(run, replaced)):
            sweep_pool(run)
    except (OSError, CheckpointError) as e:
        log.warning("tidying the pool after a save failed (the save is committed): %s", e)


SWEEP_EVERY = 10  # local pooled saves of a run per sweep of their own, in one process
_saves_unswept: dict[str, int] = {}
if hasattr(os, "register_at_fork"):  # a forked child is another process: its first save of a run sweeps too
    os.register_at_fork(after_in_child=_saves_unswept.clear)


def sweep_due(run: Storage, replaced: bool) -> bool:
    """Whether a local save (without retention) sweeps its pool: when it replaced a step (whose files may be named by
    it alone), at a process's (or forked child's) first save of the run (a killed run's debris: uncommitted
    generations), then every ``SWEEP_EVERY`` saves (saves killed meanwhile, steps deleted by hand). Not at every
    save: a sweep reads every manifest of the run, and a long run keeps hundreds of steps; ``gc`` sweeps at once."""
    key = run.url("")
    count = _saves_unswept.get(key)
    due = replaced or count is None or count + 1 >= SWEEP_EVERY
    _saves_unswept[key] = 0 if due else count + 1
    return due
