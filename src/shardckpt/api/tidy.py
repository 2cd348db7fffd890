"""``gc``, ``rm`` and ``latest``: a run's checkpoints kept tidy and found, as ``shardckpt gc`` / ``rm`` / ``latest`` do."""
from __future__ import annotations

from typing import Annotated

from shardckpt.api.results import GcResult, LatestResult, RmResult
from shardckpt.io import open_storage, where
from shardckpt.options import STORAGE, Opt, non_negative
from shardckpt.api.transform import PathLike
from shardckpt.storage_options import Options


def gc(
    path: Annotated[PathLike, Opt("checkpoint directory, run directory or fsspec URL")],
    *,
    dry_run: Annotated[bool, Opt("list what would be removed, remove nothing")] = False,
    min_age: Annotated[float | None, Opt("keep entries newer than this (default: by lock on local disk, 6 h on "
                                         "object stores)", parse=non_negative, metavar="SECONDS")] = None,
    storage_options: Annotated[Options | None, STORAGE] = None,
) -> GcResult:
    """Remove what interrupted saves left at ``path`` (never a committed checkpoint's data, never what a live
    save still writes); the same as ``shardckpt gc PATH``. A run directory (no checkpoint of its own): the
    same for every checkpoint directly below it, and the step directories a killed save left empty are
    removed (local disk). Each removal is logged (logger ``shardckpt``).

    >>> shardckpt.gc("runs/a/step-1000", dry_run=True).removed  # doctest: +SKIP
    ('data-3f2a',)
    """
    from shardckpt.checkpoint.gc import gc as run_gc

    removed = run_gc(open_storage(path, storage_options), dry_run=dry_run, min_age_s=min_age)
    return GcResult(where(path), tuple(removed), dry_run)


def rm(
    path: Annotated[PathLike, Opt("the checkpoint directory to remove")],
    *,
    force: Annotated[bool, Opt("remove it even if it is the run's latest committed checkpoint")] = False,
    storage_options: Annotated[Options | None, STORAGE] = None,
) -> RmResult:
    """Remove one checkpoint; the same as ``shardckpt rm PATH``. Its manifest is deleted first, in one atomic step
    (from then on the checkpoint does not exist), then the rest of its directory. An incremental (pooled)
    checkpoint's data stays in the run's pool while another committed checkpoint names it; ``gc`` of the run
    directory removes what no checkpoint names any more, so removing one checkpoint never breaks another. The
    run's latest committed checkpoint is refused unless ``force``.

    >>> shardckpt.rm("runs/a/step-000100").removed  # doctest: +SKIP
    'runs/a/step-000100'
    """
    from shardckpt.checkpoint.pool_gc import rm as run_rm

    return RmResult(where(path), run_rm(open_storage(path, storage_options), force=force))


def latest(
    run_dir: Annotated[PathLike, Opt("a run directory (or fsspec URL) holding step-* checkpoints")],
    *,
    storage_options: Annotated[Options | None, STORAGE] = None,
) -> LatestResult:
    """The committed checkpoint directly under ``run_dir`` with the highest step in its name (``latest`` is
    None if there is none; a directory an interrupted save left is skipped); the same as ``shardckpt latest``.

    >>> shardckpt.latest("runs/a").latest  # doctest: +SKIP
    'runs/a/step-000120'
    """
    from shardckpt.checkpoint.latest import latest_checkpoint

    return LatestResult(where(run_dir), latest_checkpoint(run_dir, storage_options=storage_options))
