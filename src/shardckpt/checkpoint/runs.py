"""Run directories: the checkpoints a training job writes below one directory (``runs/x/step-000040``, ...).

``list_checkpoints(run_dir)`` lists the directories directly below it that hold a checkpoint, or what an
interrupted save or convert left (``gc``'s debris), each with its step (from its name: ``latest.step_of``),
state, size, format, state-dict type and world size. ``latest`` is the entry ``latest_checkpoint`` picks.
``run_dir_error`` turns "no checkpoint here" for a run directory into a message naming what lies below;
``checkpoint_or_latest`` resolves ``--latest``. ``shardckpt gc RUN_DIR`` is ``gc.collect_run``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from shardckpt.checkpoint.gc import EXPORT_STAGING, GENERATION_DIR, STEP_NAME, collect, debris, is_checkpoint_dir
from shardckpt.checkpoint.latest import child_dirs, step_of
from shardckpt.checkpoint.pool import PoolUsage, pool_usage
from shardckpt.errors import BadArgumentError, CheckpointError, CheckpointNotFoundError
from shardckpt.format.manifest import FORMAT_NAME, MANIFEST_NAME
from shardckpt.io import Storage, open_storage, opened_by_name, where
from shardckpt.io.navigate import child

COMMITTED, INCOMPLETE, WRITING, EMPTY, UNREADABLE = "committed", "incomplete", "being written", "empty", "unreadable"
RUN_DIR = "run directory"  # no checkpoint itself, but committed shardckpt checkpoints below (runs/demo/checkpoints)


@dataclass(frozen=True)
class CheckpointEntry:
    """One directory below a run directory. ``state``: ``committed`` (a checkpoint is there, in ``format``),
    ``incomplete`` (nothing committed, only what a killed save/convert left: ``debris``), ``being written``
    (a live writer holds part of it; on object stores: written to recently), ``empty``, ``unreadable``
    (``detail`` says why) or ``run directory`` (checkpoints below it: ``detail`` says how many). ``debris`` may accompany a committed checkpoint too (a later killed overwrite)."""

    name: str
    path: str
    step: int | None
    state: str
    format: str | None = None  # "shardckpt", "safetensors", "torch DCP", ...
    file_bytes: int | None = None  # the committed checkpoint's files (shardckpt: its data files, from the manifest)
    state_dict_type: str | None = None
    world_size: int | None = None
    debris: list[str] = field(default_factory=list)  # what `shardckpt gc` would remove now
    debris_bytes: int = 0
    live: list[str] = field(default_factory=list)  # uncommitted entries a live writer may still use
    detail: str = ""


@dataclass(frozen=True)
class RunListing:
    """The checkpoints below ``path``, by step (unnumbered ones last), and the latest committed one."""

    path: str
    checkpoints: list[CheckpointEntry]
    latest: CheckpointEntry | None  # as ``latest_checkpoint``: the highest step with a shardckpt manifest
    pool: PoolUsage | None = None  # the run's chunk pool (incremental saves), if it has one

    def summary(self) -> str:
        """One line: how many checkpoints in each state, and the latest."""
        if not self.checkpoints:
            return "no checkpoint below"
        counts: dict[str, int] = {}
        for entry in self.checkpoints:
            counts[entry.state] = counts.get(entry.state, 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in counts.items())
        latest = f"the latest committed is {self.latest.path}" if self.latest else \
            "no shardckpt checkpoint is committed (--latest has none to pick)"
        return f"{len(self.checkpoints)} checkpoint{'s' if len(self.checkpoints) != 1 else ''} below ({states}); {latest}"


def list_checkpoints(run_dir: str | os.PathLike | Storage) -> RunListing:
    """The checkpoints directly below ``run_dir`` (a local path, or the place opened: see the module's docstring).
    Directories holding neither a checkpoint nor debris (``logs/``) are left out, and empty ones unless
    named for a step. Raises ``CheckpointNotFoundError`` when ``run_dir`` is not a directory."""
    storage = open_storage(run_dir)
    if not storage.is_dir():
        raise CheckpointNotFoundError(f"{storage.url('')}: no such directory")
    entries = []
    for name in child_dirs(storage):  # a step directory that is a link counts, as for latest_checkpoint
        if GENERATION_DIR.match(name) or EXPORT_STAGING.match(name):
            continue  # run_dir is itself a checkpoint's directory: its data, not a checkpoint
        below = child(storage, name)
        entry = _entry(below, name, where(below))
        if entry is not None:
            entries.append(entry)
    entries.sort(key=lambda e: (e.step is None, e.step or 0, e.name))
    native = [e for e in entries if e.state == COMMITTED and e.format == FORMAT_NAME and e.step is not None]
    return RunListing(where(storage), entries, max(native, key=lambda e: (e.step, e.name), default=None),
                      pool_usage(storage))


def _entry(storage: Storage, name: str, path: str) -> CheckpointEntry | None:
    try:
        return _read_entry(storage, name, path)
    except CheckpointError as e:  # a manifest that does not parse, a file gone while it was listed
        return CheckpointEntry(name, path, step_of(name), UNREADABLE, detail=str(e))


def _read_entry(storage: Storage, name: str, path: str) -> CheckpointEntry | None:
    step = step_of(name)
    removable, live = _uncommitted(storage) if is_checkpoint_dir(storage, name) else ([], [])
    extra = {"debris": removable, "debris_bytes": sum(_bytes(storage, d) for d in removable), "live": live}
    if storage.exists(MANIFEST_NAME):
        from shardckpt.formats.native import read_manifest  # (formats imports torch: only when listing one)

        manifest = read_manifest(storage)
        return CheckpointEntry(name, path, step, COMMITTED, FORMAT_NAME, sum(f.size for f in manifest.files),
                               manifest.metadata.get("state_dict_type"), manifest.world_size, **extra)
    if live or removable:
        return CheckpointEntry(name, path, step, WRITING if live else INCOMPLETE, **extra)
    if not storage.list_dirs() and not storage.list_files():
        return CheckpointEntry(name, path, step, EMPTY) if STEP_NAME.search(name) else None
    return _foreign(storage, name, path, step)


def _foreign(storage: Storage, name: str, path: str, step: int | None) -> CheckpointEntry | None:
    """A checkpoint of another format (an export, a torch DCP directory), or None when nothing reads it."""
    from shardckpt.checkpoint.describe import format_description
    from shardckpt.formats.detect import open_reader

    try:
        reader = open_reader(storage, verify=False)
    except CheckpointNotFoundError:
        below = sum(storage.exists(f"{d}/{MANIFEST_NAME}") for d in storage.list_dirs())
        return CheckpointEntry(name, path, step, RUN_DIR, detail=f"{below} committed below") if below else None
    except CheckpointError as e:
        return CheckpointEntry(name, path, step, UNREADABLE, detail=str(e))
    description, _ = format_description(reader, storage)
    return CheckpointEntry(name, path, step, COMMITTED, reader.facts().format, _bytes(storage, ""), detail=description)


def _uncommitted(storage: Storage) -> tuple[list[str], list[str]]:
    """What ``gc`` would remove now at ``storage``, and the uncommitted entries it would keep (a live writer's)."""
    candidates = debris(storage)
    removable = collect(storage, dry_run=True) if candidates else []
    return removable, [d for d in candidates if d not in removable]


def _bytes(storage: Storage, path: str) -> int:
    """The bytes of file or directory ``path`` (``""``: all of ``storage``), everything below it."""
    prefix = f"{path}/" if path else ""
    if path and not storage.is_dir(path):
        return storage.file_size(path) if storage.exists(path) else 0
    files = sum(storage.file_size(prefix + f) for f in storage.list_files(path))
    return files + sum(_bytes(storage, prefix + d) for d in storage.list_dirs(path))


def run_dir_error(place: Storage) -> CheckpointNotFoundError | None:
    """For a place that holds no checkpoint itself: if checkpoints lie below it (a run directory), the error that
    says which and how to pick one (else None: the caller's own error stands, as for a place that is a committed
    checkpoint itself, with others below it: the error was another path's). Only a place opened from a path or
    URL (``io.named``) is looked below: a ``Storage`` the caller made is one checkpoint's place."""
    if not opened_by_name(place):
        return None
    path = where(place)
    try:
        if place.exists(MANIFEST_NAME):
            return None
        listing = list_checkpoints(place)
    except CheckpointError:
        return None
    if not listing.checkpoints:
        return None
    names = [e.name for e in listing.checkpoints]
    shown = ", ".join(names[:3] + ["..."] + names[-2:] if len(names) > 6 else names)
    pick = f"pass it, or latest=True (`shardckpt ls {path}` lists them)" if listing.latest else \
        f"`shardckpt ls {path}` says what each holds"
    return CheckpointNotFoundError(f"{path}: a run directory, not a checkpoint: {listing.summary()} "
                                   f"[{shown}]; {pick}")


def checkpoint_or_latest(place: Storage, *, required: bool = True) -> Storage:
    """The latest committed checkpoint below run directory ``place`` (``RunListing.latest``). Where there is
    none: ``CheckpointNotFoundError`` naming what lies below, or, not ``required``, ``place``. A run directory is
    opened from a path or URL (``io.named``): ``latest`` with a ``Storage`` the caller made is refused."""
    if not opened_by_name(place):
        raise BadArgumentError(f"{where(place)}: latest=True looks below a run directory, named by a path or URL; "
                               "a Storage is one checkpoint's place")
    listing = list_checkpoints(place)
    if listing.latest is not None:
        return child(place, listing.latest.name)
    if not required:
        return place
    raise CheckpointNotFoundError(f"{where(place)}: latest=True: {listing.summary()}")
