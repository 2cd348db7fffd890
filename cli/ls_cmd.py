"""``shardckpt ls RUN_DIR``: the checkpoints below a run directory, with step, state, size, type and world size
(``shardckpt.ls``; this module prints its result)."""
from __future__ import annotations

import argparse

from shardckpt.api.results import LsResult
from shardckpt.sizes import format_bytes

EPILOG = """states: committed (a checkpoint is there); incomplete (nothing committed: what a killed save or convert
left, which `shardckpt gc RUN_DIR` removes); being written (a live save holds it; on object stores: written
to in the last hours); empty; unreadable; run directory (checkpoints below it: ls it). "debris" beside a
committed checkpoint: what a later killed overwrite left. The latest (marked *) is what `shardckpt latest`
and --latest pick: the highest step with a committed shardckpt checkpoint.

examples:
  shardckpt ls runs/example
  shardckpt ls s3://bucket/run --json | jq -r .latest_path
"""


def show(result: LsResult, args: argparse.Namespace) -> None:
    if args.json or args.quiet:
        return
    print(f"{result.path}: {result.summary}")
    if not result.checkpoints:
        return
    rows = [_row(e, e["name"] == result.latest) for e in result.checkpoints]
    header = ("", "name", "step", "state", "format", "type", "world", "files", "debris")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if result.pool is not None:
        print(_pool_line(result.pool))


def _pool_line(pool: dict) -> str:
    """The chunk pool the steps share (their "files" count shared data once per step)."""
    if pool.get("problem"):
        return f"pool: {pool['path']} is damaged ({pool['problem']}); `shardckpt verify RUN_DIR` says which steps"
    line = (f"pool: {format_bytes(pool['bytes'])} in {pool['files']} files, {pool['generations']} generation"
            f"{'s' if pool['generations'] != 1 else ''} (the steps' files are shared here)")
    if pool["unnamed_files"] is None:
        return line + "; a manifest could not be read: what no step names is unknown"
    if pool["unnamed_files"]:
        line += (f"; {format_bytes(pool['unnamed_bytes'])} in {pool['unnamed_files']} files named by no committed "
                 "checkpoint (`shardckpt gc RUN_DIR` removes them; on object stores once 6 h old)")
    return line


def _row(e: dict, latest: bool) -> tuple[str, ...]:
    debris = f"{len(e['debris'])} ({format_bytes(e['debris_bytes'])})" if e["debris"] else ""
    debris += f"{' + ' if debris else ''}{len(e['live'])} held" if e["live"] else ""
    state = e["state"] + (f": {e['detail']}" if e["state"] in ("unreadable", "run directory") else "")
    return ("*" if latest else "", e["name"], "-" if e["step"] is None else str(e["step"]), state, e["format"] or "-",
            e["state_dict_type"] or "-", "-" if e["world_size"] is None else str(e["world_size"]),
            "-" if e["file_bytes"] is None else format_bytes(e["file_bytes"]), debris or "-")
