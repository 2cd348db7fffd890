"""Run directories in the verbs: ``latest=True`` (the latest committed checkpoint below a path), the error
that names the checkpoints below a run directory given where one checkpoint was expected, and ``ls``. The
work is ``checkpoint.runs``'s (imported when called)."""
from __future__ import annotations

import contextlib
import os
from typing import Annotated, Iterator

from shardckpt.api.results import LsResult
from shardckpt.io import Storage, open_storage
from shardckpt.options import STORAGE, Opt
from shardckpt.storage_options import Options

LATEST = Opt("PATH is a run directory: use the latest committed checkpoint below it (the highest step; "
             "`shardckpt ls` lists them)")


def ls(
    run_dir: Annotated[str | os.PathLike, Opt("run directory or fsspec URL")],
    *,
    storage_options: Annotated[Options | None, STORAGE] = None,
) -> LsResult:
    """The checkpoints directly below ``run_dir`` (e.g. the ``step-*`` directories a training loop writes):
    name, step, state (committed, incomplete, being written, empty, unreadable, run directory), format,
    state-dict type, world size, size and debris; ``latest`` is what ``latest=True`` picks. The same as
    ``shardckpt ls RUN_DIR``.

    >>> shardckpt.ls("runs/a").latest_path  # doctest: +SKIP
    'runs/a/step-000120'
    """
    from dataclasses import asdict

    from shardckpt.checkpoint.runs import list_checkpoints

    listing = list_checkpoints(open_storage(run_dir, storage_options))
    latest = listing.latest
    return LsResult(listing.path, None if latest is None else latest.name, None if latest is None else latest.path,
                    tuple(asdict(e) for e in listing.checkpoints), listing.summary(),
                    None if listing.pool is None else asdict(listing.pool))


def resolve(place: Storage, latest: bool, required: bool = True) -> Storage:
    """``place`` (opened at the verb's edge), or with ``latest`` the latest committed checkpoint below it
    (``checkpoint_or_latest``)."""
    if not latest:
        return place
    from shardckpt.checkpoint.runs import checkpoint_or_latest

    return checkpoint_or_latest(place, required=required)


@contextlib.contextmanager
def explaining_run_dirs(*places: Storage) -> Iterator[None]:
    """A "no checkpoint here" error for one of ``places`` that is a run directory becomes one that names the
    checkpoints below it and the latest."""
    from shardckpt.errors import CheckpointNotFoundError

    try:
        yield
    except CheckpointNotFoundError as e:
        from shardckpt.checkpoint.runs import run_dir_error

        for place in places:
            better = run_dir_error(place)
            if better is not None:
                raise better from e
        raise
