"""Run directories on the command line: ``--latest`` (the latest committed checkpoint below a path), and an
error that names the checkpoints below a run directory given where one checkpoint was expected."""
from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from shardckpt.cli.options import storage_options

from shardckpt.checkpoint.runs import checkpoint_or_latest, run_dir_error
from shardckpt.errors import CheckpointNotFoundError


def add_latest(parser: argparse.ArgumentParser, which: str = "PATH") -> None:
    parser.add_argument("--latest", action="store_true",
                        help=f"{which} is a run directory: use the latest committed checkpoint below it "
                             "(the highest step; `shardckpt ls` lists them)")


def resolve(args: argparse.Namespace, path: str, required: bool = True) -> str:
    """``path``, or with ``--latest`` the latest committed checkpoint below it (see ``checkpoint_or_latest``)."""
    return checkpoint_or_latest(path, latest=args.latest, storage_options=storage_options(args), required=required)


@contextlib.contextmanager
def explaining_run_dirs(args: argparse.Namespace, *paths: str) -> Iterator[None]:
    """A "no checkpoint here" error for one of ``paths`` that is a run directory becomes one that names the
    checkpoints below it and the latest."""
    try:
        yield
    except CheckpointNotFoundError as e:
        for path in paths:
            better = run_dir_error(path, storage_options=storage_options(args))
            if better is not None:
                raise better from e
        raise
