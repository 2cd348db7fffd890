"""``shardckpt gc PATH``: remove what interrupted saves left behind (``shardckpt.gc``; this module prints
its result)."""
from __future__ import annotations

import argparse

from shardckpt.api.results import GcResult

EPILOG = """what is removed: data-<generation>/ directories the committed manifest does not name, and
manifest.json.tmp-* and *.export-tmp-* files, unless a live save may still use them: on local disk a writer
holds a lock on what it writes (it dies with the process); on object stores (no locks) anything newer than
6 h is kept (--min-age to change).
A successful save does the same at its path after it commits. PATH a run directory (no checkpoint of its
own): the same for every checkpoint directly below it, and the step-* directories a killed save left empty
are removed (on local disk; never one a live process holds or anything has been written into), and its
shardckpt-pool/ (incremental saves) loses the files no committed checkpoint names: on local disk never one a
live save holds; on object stores never one a live save's lease names, nor one newer than --min-age (6 h).

examples:
  shardckpt gc /ckpt/step-1000 --dry-run
  shardckpt gc runs/example                  (every step-* below it: step-000050/data-..., step-000050/)
  shardckpt gc s3://bucket/run/step-1000 --min-age 600
"""


def show(result: GcResult, args: argparse.Namespace) -> None:
    if args.json:
        return
    verb = "would remove" if result.dry_run else "removed"
    if not args.quiet:
        for name in result.removed:
            print(f"{verb} {name}")
        count = len(result.removed)
        print(f"{result.path}: {verb} {count} {'entry' if count == 1 else 'entries'}")
