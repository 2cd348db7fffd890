"""``shardckpt diff A B``: are two checkpoints (any readable formats) the same, tensor by tensor?"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, non_negative, storage_options

from shardckpt.offline.diff import diff

EPILOG = """compares: the tensors each side holds (by name), their shapes and dtypes, their values (by checksum
where both sides store one, else read in bounded slices), and the plain values. Exact (bit for bit) unless
--atol/--rtol is given; a tolerance applies to floating-point values only (integers and bools are always
compared exactly). Exit 0: equal; 1: they differ; 2: a side is unreadable.

examples:
  shardckpt diff /ckpt/step-1000 /converted/step-1000
  shardckpt diff model.safetensors /ckpt/step-1000 --rtol 1e-3 --json
"""
MAX_SHOWN = 20


def register(sub) -> None:
    p = sub.add_parser("diff", help="compare two checkpoints of any readable formats",
                       description="Compare checkpoints A and B tensor by tensor, and their plain values.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="a checkpoint, file or fsspec URL (shardckpt, torch DCP, safetensors, torch.save)")
    p.add_argument("b", help="the other one")
    p.add_argument("--atol", type=non_negative, default=0.0, help="absolute tolerance for values (default 0: exact)")
    p.add_argument("--rtol", type=non_negative, default=0.0, help="relative tolerance for values (default 0: exact)")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, storage_options=storage_options(args))
    if args.json:
        print(json.dumps({"equal": report.equal, "tensors": report.tensors, "by_checksum": report.by_checksum,
                          "bytes_read": report.bytes_read, "plain_values": report.plain_values,
                          "differences": [asdict(d) for d in report.differences]}, indent=2))
    else:
        summary = (f"{report.tensors} tensors compared ({report.by_checksum} by checksum, "
                   f"{report.bytes_read} bytes read), {report.plain_values} plain values")
        if report.equal:
            print(f"equal: {summary}")
        else:
            print(f"DIFFERENT: {len(report.differences)} differences; {summary}")
            for d in report.differences[:MAX_SHOWN]:
                print(f"  {d.name}: {d.kind}: {d.detail}")
            if len(report.differences) > MAX_SHOWN:
                print(f"  ... and {len(report.differences) - MAX_SHOWN} more (--json lists all)", file=sys.stderr)
    return 0 if report.equal else 1
