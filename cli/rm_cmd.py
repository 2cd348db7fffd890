"""``shardckpt rm PATH``: remove one checkpoint, never breaking another (``shardckpt.rm``; this module prints its
result)."""
from __future__ import annotations

import argparse

from shardckpt.api.results import RmResult

EPILOG = """how: the manifest is deleted first, in one atomic step (from then on the checkpoint does not exist;
a load in progress fails as after any removal), then what is left of the directory. An incremental checkpoint
(save(..., incremental=True)) keeps its data in the run directory's shardckpt-pool/, shared with other steps:
that data stays while any committed checkpoint names it, and `shardckpt gc RUN_DIR` removes the rest.

examples:
  shardckpt rm runs/ft/step-000100
  shardckpt rm runs/ft/step-000100 && shardckpt gc runs/ft
"""


def show(result: RmResult, args: argparse.Namespace) -> None:
    if args.json or args.quiet:
        return
    print(f"removed {result.removed}")
