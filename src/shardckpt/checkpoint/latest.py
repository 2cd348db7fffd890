"""``latest_checkpoint``: where a job resumes from, the newest committed checkpoint under a run directory."""
from __future__ import annotations

import os
import re

from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.errors import BadArgumentError
from shardckpt.io.navigate import child
from shardckpt.io import LocalStorage, Storage, is_named, open_storage, opened_by_name, where
from shardckpt.storage_options import Options

_STEP = re.compile(r"step[-_=]?(\d+)(?![A-Za-z\d.])", re.IGNORECASE)  # not step1k, step1.5k, step-2e3
_NUMBER = re.compile(r"(?<![A-Za-z\d.])\d+(?![A-Za-z\d.])")  # a number of its own: not fp16, v2, ws3, 1.5


def step_of(name: str) -> int | None:
    """The step a checkpoint's directory name gives: the number after ``step`` (``step-1000``,
    ``global_step500``, ``step_000120-ws3``, ``epoch=1-step=500``), else the last number standing on its own in it
    (``ckpt-300``, ``checkpoint_500``; not the 16 of ``export-fp16``, which has no step), else None. Retention and
    ``latest`` go by it: a name with no step is never taken for one."""
    found = _STEP.findall(name) or _NUMBER.findall(name)
    return int(found[-1]) if found else None


def child_dirs(run: Storage) -> list[str]:
    """The run's child directories, links to directories included (``list_dirs`` leaves links out, so that no
    collector follows one): a checkpoint directory may be a link (its data on another disk), and what its
    manifest names must count as named."""
    if not isinstance(run, LocalStorage):
        return run.list_dirs("")
    try:
        with os.scandir(run.root) as entries:
            return sorted(e.name for e in entries if e.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def latest_checkpoint(root: str | os.PathLike | Storage, *, storage_options: Options | None = None) -> str | None:
    """The committed checkpoint directly under ``root`` (a path, an fsspec URL, or a run directory opened with
    ``open_storage``) with the highest step in its
    name (``step_of``), or None if there is none. A directory without a committed manifest, such as one
    an interrupted save left, is skipped; among equal steps the last name in sorted order wins. A step directory
    that is a link counts (``child_dirs``)."""
    if not is_named(root) and not opened_by_name(root):
        raise BadArgumentError(f"{where(root)}: latest_checkpoint looks below a run directory, named by a path or "
                               "URL; a Storage is one checkpoint's place")
    latest = latest_in(open_storage(root, storage_options))
    return None if latest is None else where(latest)


def latest_in(run: Storage) -> Storage | None:
    """The committed checkpoint directly under run directory ``run`` with the highest step in its name (see
    ``latest_checkpoint``), or None."""
    named = sorted(((step, name) for name in child_dirs(run) if (step := step_of(name)) is not None), reverse=True)
    for _, name in named:
        if run.exists(f"{name}/{MANIFEST_NAME}"):
            return child(run, name)
    return None
