"""``shardckpt ls RUN_DIR``: the checkpoints below a run directory, with step, state, size, type and world size."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from shardckpt.cli.inspect_cmd import _size
from shardckpt.cli.options import STORAGE_HELP, add_storage_options, storage_options

from shardckpt.checkpoint.runs import list_checkpoints

EPILOG = """states: committed (a checkpoint is there); incomplete (nothing committed: what a killed save or convert
left, which `shardckpt gc RUN_DIR` removes); being written (a live save holds it; on object stores: written
to in the last hours); empty; unreadable; run directory (checkpoints below it: ls it). "debris" beside a
committed checkpoint: what a later killed overwrite left. The latest (marked *) is what `latest_checkpoint`
and `--latest` pick: the highest step with a committed shardckpt checkpoint.

examples:
  shardckpt ls runs/example
  shardckpt ls s3://bucket/run --json | jq -r .latest_path
"""


def register(sub) -> None:
    p = sub.add_parser("ls", help="list the checkpoints below a run directory",
                       description="List the checkpoints directly below RUN_DIR (e.g. the step-* directories a "
                                   "training loop writes): step, state, format, state-dict type, world size, size.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory or fsspec URL")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (checkpoints: name, step, state, ...)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    listing = list_checkpoints(args.run_dir, storage_options=storage_options(args))
    if args.json:
        print(json.dumps({"path": listing.path, "latest": listing.latest.name if listing.latest else None,
                          "latest_path": listing.latest.path if listing.latest else None,
                          "checkpoints": [asdict(e) for e in listing.checkpoints]}, indent=2))
        return 0
    print(f"{listing.path}: {listing.summary()}")
    if not listing.checkpoints:
        return 0
    rows = [_row(e, e is listing.latest) for e in listing.checkpoints]
    header = ("", "name", "step", "state", "format", "type", "world", "files", "debris")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _row(e, latest: bool) -> tuple[str, ...]:
    debris = f"{len(e.debris)} ({_size(e.debris_bytes)})" if e.debris else ""
    debris += f"{' + ' if debris else ''}{len(e.live)} held" if e.live else ""
    state = e.state + (f": {e.detail}" if e.state in ("unreadable", "run directory") else "")
    return ("*" if latest else "", e.name, "-" if e.step is None else str(e.step), state, e.format or "-",
            e.state_dict_type or "-", "-" if e.world_size is None else str(e.world_size),
            "-" if e.file_bytes is None else _size(e.file_bytes), debris or "-")
