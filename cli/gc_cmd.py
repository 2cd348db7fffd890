"""``shardckpt gc PATH``: remove what interrupted saves left behind (never a committed checkpoint's data)."""
from __future__ import annotations

import argparse

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, non_negative, storage_options

from shardckpt.checkpoint.gc import REMOTE_MIN_AGE_S, gc

EPILOG = f"""what is removed: data-<generation>/ directories the committed manifest does not name, and
manifest.json.tmp-* and *.export-tmp-* files, unless a live save may still use them: on local disk a writer
holds a lock on what it writes (it dies with the process); on object stores (no locks) anything newer than
{REMOTE_MIN_AGE_S / 3600:.0f} h is kept (--min-age to change).
A successful save does the same at its path after it commits. PATH a run directory (no checkpoint of its
own): the same for every checkpoint directly below it, and the step-* directories a killed save left empty
are removed (on local disk; never one a live process holds or anything has been written into).

examples:
  shardckpt gc /ckpt/step-1000 --dry-run
  shardckpt gc runs/example                  (every step-* below it: step-000050/data-..., step-000050/)
  shardckpt gc s3://bucket/run/step-1000 --min-age 600
"""


def register(sub) -> None:
    p = sub.add_parser("gc", help="remove what interrupted saves left behind",
                       description="Remove the debris of interrupted saves at PATH; the committed checkpoint and "
                                   "saves still running are never touched.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint directory, run directory or fsspec URL")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--min-age", type=non_negative, metavar="SECONDS",
                   help="keep entries newer than this (default: by lock on local disk, the ages above otherwise)")
    add_storage_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    removed = gc(args.path, dry_run=args.dry_run, min_age_s=args.min_age, storage_options=storage_options(args))
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {name}")
    print(f"{args.path}: {verb} {len(removed)} {'entry' if len(removed) == 1 else 'entries'}")
    return 0
