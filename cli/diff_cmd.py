"""``shardckpt diff A B``: are two checkpoints (any readable formats) the same, tensor by tensor?
(``shardckpt.diff``; this module prints its result.)"""
from __future__ import annotations

import argparse
import sys

from shardckpt.api.results import DiffResult
from shardckpt.cli.verbs import in_cli_words
from shardckpt.sizes import format_bytes

EPILOG = """compares: the tensors each side holds (by name), their shapes and dtypes, their values (by checksum
where both sides store one, else read in bounded slices; --read-all reads every one: a CRC32C can be made to
collide), and the plain values (of the same types: 1 is not True, 0.0 is not -0.0). Exact (bit for bit) unless
--atol/--rtol is given; a tolerance applies to floating-point values only (integers and bools are always
compared exactly), and with one, floating-point tensors of different dtypes (fp32 against a bf16 export) are
compared by value within it, their dtypes reported apart. The __metadata__ of safetensors files (an export
records its source's path there) is reported apart and never makes two checkpoints different.
Exit 0: equal; 1: they differ; 2: a side is unreadable.

examples:
  shardckpt diff /ckpt/step-1000 /converted/step-1000
  shardckpt diff model.safetensors /ckpt/step-1000 --rtol 1e-3 --json
  shardckpt diff /ckpt/step-1000 /export/step-1000 --only model --strip-prefix model.   (a checkpoint vs its export;
                                                       `shardckpt verify /export/step-1000 --against /ckpt/step-1000`
                                                       checks an export as export wrote it)
  shardckpt diff runs/a runs/b --latest               (the latest committed step-* of two run directories)
"""
MAX_SHOWN = 20


def show(result: DiffResult, args: argparse.Namespace) -> None:
    if args.json:
        return
    summary = (f"{result.tensors} tensors compared ({result.by_checksum} by checksum, "
               f"{format_bytes(result.bytes_read)} of tensor data read), {result.plain_values} plain values")
    if result.equal:
        print(f"equal: {summary}")
    else:
        print(f"DIFFERENT: {len(result.differences)} differences; {summary}")
        for d in result.differences[:MAX_SHOWN]:
            print(f"  {d.name}: {d.kind}: {d.detail}")
        if len(result.differences) > MAX_SHOWN:
            print(f"  ... and {len(result.differences) - MAX_SHOWN} more (--json lists all)", file=sys.stderr)
    if result.dtype_differences:
        shown = ", ".join(f"{d.name} ({d.detail})" for d in result.dtype_differences[:3])
        more = f" and {len(result.dtype_differences) - 3} more" if len(result.dtype_differences) > 3 else ""
        print(f"dtypes differ, values compared within the tolerance: {shown}{more}")
    if result.metadata_differences:
        print("file metadata differs (not tensor data): " + "; ".join(
            f"{d.name.split('.', 1)[1]}: {d.detail}" for d in result.metadata_differences))
    for note in result.notes:
        print(f"note: {in_cli_words(note, args.spec)}")
