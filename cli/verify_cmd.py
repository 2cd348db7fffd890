"""``shardckpt verify PATH``: prove a checkpoint complete and uncorrupted; ``verify DST --against SRC``: prove an
export holds the source's values."""
from __future__ import annotations

import argparse
import json
import sys

from shardckpt.cli.options import STORAGE_HELP, add_rename_map, add_storage_options, bounded_int, storage_options
from shardckpt.cli.progress import Progress

from shardckpt.checkpoint.describe import foreign_format
from shardckpt.checkpoint.verify import verify
from shardckpt.io import DEFAULT_IO_THREADS
from shardckpt.offline.verify_export import verify_export
from shardckpt.errors import CheckpointError, CorruptCheckpointError

EPILOG = """checks: the manifest's own checksum (format v2 on); every data file present with its recorded
size; every chunk index intact; chunks tile every tensor exactly once; every checksum block of every
chunk (a failure names its byte range); every tensor's sharding-independent checksum.

An exported safetensors directory (`shardckpt export`) is checked for its structure (headers within
their files, the index placing every tensor and naming every file, its total_size); with --against SRC
every value is compared with the source as export reads it (the same --only/--strip-prefix), bit for
bit after the export's cast.

examples:
  shardckpt verify /ckpt/step-1000
  shardckpt verify s3://bucket/run/step-1000 --quiet && echo sound
  shardckpt verify ./hf-out --against /ckpt/step-1000
"""


def register(sub) -> None:
    p = sub.add_parser("verify", help="check that a checkpoint is complete and uncorrupted",
                       description="Read every byte of a checkpoint and check it against its checksums. "
                                   "Exit 0 when sound, 1 when not (each bad tensor and file is named).",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint directory or fsspec URL")
    add_storage_options(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--against", metavar="SRC", help="PATH is an export: compare its every value with SRC's")
    p.add_argument("--only", nargs="+", metavar="PREFIX", help="with --against: what export was given")
    p.add_argument("--strip-prefix", metavar="P", help="with --against: what export was given")
    add_rename_map(p, "with --against: what export was given, ")
    p.add_argument("--threads", type=bounded_int(1, 256), default=DEFAULT_IO_THREADS,
                   help=f"parallel reads (default {DEFAULT_IO_THREADS})")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    other = foreign_format(args.path, storage_options=storage_options(args))
    if args.against is not None or (other is not None and other.startswith("safetensors")):
        return _run_export(args)
    if other is not None:
        print(f"shardckpt verify: error: {args.path}: {other}, not a shardckpt checkpoint; verify checks shardckpt "
              "checkpoints against the checksums they store (`shardckpt inspect` lists this one)", file=sys.stderr)
        return 2
    progress = Progress("verify", quiet=args.quiet)
    try:
        report = verify(args.path, storage_options=storage_options(args), io_threads=args.threads,
                        progress=progress)
    except CorruptCheckpointError as e:
        progress.close()
        print(f"FAILED {args.path}: {e}", file=sys.stderr)
        return 1
    progress.close()
    if args.json:
        print(json.dumps({"ok": report.ok, "version": report.version,
                          "manifest_checksum": report.manifest_checksum,
                          "tensors": report.tensors, "chunks": report.chunks,
                          "bytes_checked": report.bytes_checked,
                          "problems": [{"tensor": p.tensor, "file": p.file, "message": p.message}
                                       for p in report.problems]}, indent=2))
    elif report.ok:
        manifest = ("manifest checksum OK" if report.manifest_checksum else
                    f"format v{report.version}: its manifest has no checksum, not checked")
        print(f"OK {args.path}: {report.tensors} tensors, {report.chunks} chunks, "
              f"{report.bytes_checked:,} bytes checked, {manifest}")
    else:
        for problem in report.problems:
            print(f"BAD {problem}", file=sys.stderr)
        print(f"FAILED {args.path}: {len(report.problems)} problem(s) in {report.tensors} tensors", file=sys.stderr)
    return 0 if report.ok else 1


def _run_export(args: argparse.Namespace) -> int:
    try:
        check = verify_export(args.path, against=args.against, only=args.only, strip_prefix=args.strip_prefix,
                              rename=args.rename_map,
                              storage_options=storage_options(args), dst_storage_options=storage_options(args))
    except CheckpointError as e:
        print(f"FAILED {args.path}: {e}", file=sys.stderr)
        return 1
    values = check.values
    if args.json:
        print(json.dumps({"ok": check.ok, "files": check.files, "tensors": check.tensors, "bytes": check.bytes,
                          "problems": check.problems,
                          "differences": None if values is None else
                          [{"tensor": d.name, "kind": d.kind, "detail": d.detail} for d in values.differences]},
                         indent=2))
    elif check.ok:
        against = "" if values is None else f", every value equal to {args.against}'s ({values.bytes_read:,} bytes read)"
        print(f"OK {args.path}: {check.files} files, {check.tensors} tensors, {check.bytes:,} bytes{against}")
    else:
        for problem in check.problems:
            print(f"BAD {problem}", file=sys.stderr)
        for d in [] if values is None else values.differences:
            print(f"BAD {d.name}: {d.kind}: {d.detail}", file=sys.stderr)
        count = len(check.problems) + (0 if values is None else len(values.differences))
        print(f"FAILED {args.path}: {count} problem(s)", file=sys.stderr)
    return 0 if check.ok else 1
