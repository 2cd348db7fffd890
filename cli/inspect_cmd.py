"""``shardckpt inspect PATH``: what a checkpoint holds, from its manifest."""
from __future__ import annotations

import argparse
import json

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, storage_options

from shardckpt.checkpoint.describe import describe

EPILOG = """examples:
  shardckpt inspect /ckpt/step-1000
  shardckpt inspect s3://bucket/run/step-1000 --json | jq '.tensors[] | select(.dtype == "bfloat16")'
"""


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's tensors, sizes and checksums",
                       description="Show format, world size, state-dict type, total bytes and one row per tensor.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint directory or fsspec URL")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (tensors: name, dtype, shape, ...)")
    p.set_defaults(run=run)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    info = describe(args.path, storage_options=storage_options(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}: {info['format']} v{info['version']} ({info['created_by']}), world size "
          f"{info['world_size']}, state dict type {info['state_dict_type'] or '-'}, {len(info['tensors'])} tensors, "
          f"{_size(info['total_bytes'])} in {info['files']} files")
    if info["manifest_checksum"]:
        print(f"  manifest checksummed; chunk checksums per {_size(info['block_size'] or 0)} block")
    else:
        print(f"  format v{info['version']}: no manifest checksum, one checksum per whole chunk (a partial read "
              "checks its whole chunk)")
    rows = [(t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(t["bytes"]), t["crc32c"])
            for t in info["tensors"]]
    header = ("name", "dtype", "shape", "bytes", "crc32c")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
