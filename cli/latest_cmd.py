"""``shardckpt latest RUN_DIR``: the path of the latest committed checkpoint under a run directory
(``shardckpt.latest``; this module prints it). Exit 1 when there is none."""
from __future__ import annotations

import argparse
import sys

from shardckpt.api.results import LatestResult

EPILOG = """which: the directory directly under RUN_DIR with the highest step in its name (step-1000,
global_step500, ckpt-300; a name with no number of its own, such as export-fp16, has none) that holds a committed
checkpoint; one an interrupted save left is skipped.

examples:
  shardckpt latest runs/example
  torchrun ... train.py --resume "$(shardckpt latest runs/example)"
"""


def show(result: LatestResult, args: argparse.Namespace) -> None:
    if args.json:
        return
    if result.latest is None:
        print(f"shardckpt latest: {result.run_dir}: no committed checkpoint below", file=sys.stderr)
    else:
        print(result.latest)
