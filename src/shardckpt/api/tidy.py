"""``gc`` and ``latest``: a run's checkpoints kept tidy and found, as ``shardckpt gc`` / ``latest`` do."""
from __future__ import annotations

import os
from typing import Annotated

from shardckpt.api.results import GcResult, LatestResult
from shardckpt.options import STORAGE, Opt, non_negative
from shardckpt.api.transform import PathLike


def gc(
    path: Annotated[PathLike, Opt("checkpoint directory, run directory or fsspec URL")],
    *,
    dry_run: Annotated[bool, Opt("list what would be removed, remove nothing")] = False,
    min_age: Annotated[float | None, Opt("keep entries newer than this (default: by lock on local disk, 6 h on "
                                         "object stores)", parse=non_negative, metavar="SECONDS")] = None,
    storage_options: Annotated[dict | None, STORAGE] = None,
) -> GcResult:
    """Remove what interrupted saves left at ``path`` (never a committed checkpoint's data, never what a live
    save still writes); the same as ``shardckpt gc PATH``. A run directory (no checkpoint of its own): the
    same for every checkpoint directly below it, and the step directories a killed save left empty are
    removed (local disk). Each removal is logged (logger ``shardckpt``).

    >>> shardckpt.gc("runs/a/step-1000", dry_run=True).removed  # doctest: +SKIP
    ('data-3f2a',)
    """
    from shardckpt.checkpoint.gc import gc as run_gc

    removed = run_gc(path, dry_run=dry_run, min_age_s=min_age, storage_options=storage_options)
    return GcResult(os.fspath(path), tuple(removed), dry_run)


def latest(
    run_dir: Annotated[PathLike, Opt("a run directory (or fsspec URL) holding step-* checkpoints")],
    *,
    storage_options: Annotated[dict | None, STORAGE] = None,
) -> LatestResult:
    """The committed checkpoint directly under ``run_dir`` with the highest step in its name (``latest`` is
    None if there is none; a directory an interrupted save left is skipped); the same as ``shardckpt latest``.

    >>> shardckpt.latest("runs/a").latest  # doctest: +SKIP
    'runs/a/step-000120'
    """
    from shardckpt.checkpoint.latest import latest_checkpoint

    return LatestResult(os.fspath(run_dir), latest_checkpoint(run_dir, storage_options=storage_options))
