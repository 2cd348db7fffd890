"""``shardckpt diff A B``: are two checkpoints (any readable formats) the same, tensor by tensor?
(``shardckpt.diff``; this module prints its result.)"""
from __future__ import annotations

import argparse
import sys

from shardckpt.api.results import DiffResult
from shardckpt.sizes import format_bytes

EPILOG = """compares: the tensors each side holds (by name), their shapes and dtypes, their values (by checksum
where both sides store one, else read in bounded slices), and the plain values. Exact (bit for bit) unless
--atol/--rtol is given; a tolerance applies to floating-point values only (integers and bools are always
compared exactly). Exit 0: equal; 1: they differ; 2: a side is unreadable.

examples:
  shardckpt diff /ckpt/step-1000 /converted/step-1000
  shardckpt diff model.safetensors /ckpt/step-1000 --rtol 1e-3 --json
"""
MAX_SHOWN = 20


def show(result: DiffResult, args: argparse.Namespace) -> None:
    if args.json:
        return
    summary = (f"{result.tensors} tensors compared ({result.by_checksum} by checksum, "
               f"{format_bytes(result.bytes_read)} of tensor data read), {result.plain_values} plain values")
    if result.equal:
        print(f"equal: {summary}")
        return
    print(f"DIFFERENT: {len(result.differences)} differences; {summary}")
    for d in result.differences[:MAX_SHOWN]:
        print(f"  {d.name}: {d.kind}: {d.detail}")
    if len(result.differences) > MAX_SHOWN:
        print(f"  ... and {len(result.differences) - MAX_SHOWN} more (--json lists all)", file=sys.stderr)
