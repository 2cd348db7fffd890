"""``shardckpt diff A B``: are two checkpoints (any readable formats) the same, tensor by tensor?"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, non_negative, storage_options
from shardckpt.cli.progress import Progress
from shardckpt.cli.run_dirs import add_latest, explaining_run_dirs, resolve

from shardckpt.convert.diff import DiffReport, diff

EPILOG = """compares: the tensors each side holds (by name), their shapes and dtypes, their values (by checksum
where both sides store one, else read in bounded slices), and the plain values. Exact (bit for bit) unless
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


def register(sub) -> None:
    p = sub.add_parser("diff", help="compare two checkpoints of any readable formats",
                       description="Compare checkpoints A and B tensor by tensor, and their plain values.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="a checkpoint, file or fsspec URL (shardckpt, torch DCP, safetensors, torch.save)")
    p.add_argument("b", help="the other one")
    p.add_argument("--atol", type=non_negative, default=0.0, help="absolute tolerance for values (default 0: exact)")
    p.add_argument("--rtol", type=non_negative, default=0.0, help="relative tolerance for values (default 0: exact)")
    p.add_argument("--only", action="append", default=None, metavar="PREFIX",
                   help="compare only the tensors and values under this dotted-name prefix (repeatable), on each "
                        "side that has any (a side with none is compared whole)")
    p.add_argument("--strip-prefix", metavar="P", help="remove this prefix from the names that start with it (after "
                                                      "--only), e.g. model. against an export")
    add_latest(p, "A or B")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    a, b = _sides(args)
    progress = Progress("diff", quiet=args.quiet or args.json)
    try:
        with explaining_run_dirs(args, a, b):
            report = diff(a, b, atol=args.atol, rtol=args.rtol, only=args.only, strip_prefix=args.strip_prefix,
                          storage_options=storage_options(args), progress=progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(_json(report), indent=2))
    else:
        _print(report)
    return 0 if report.equal else 1


def _sides(args: argparse.Namespace) -> tuple[str, str]:
    """A and B, with --latest each run directory among them replaced by its latest committed checkpoint."""
    a, b = (resolve(args, p, required=False) for p in (args.a, args.b))
    if args.latest and (a, b) == (args.a, args.b):
        raise argparse.ArgumentTypeError(f"--latest: neither {args.a} nor {args.b} has a committed checkpoint below it")
    return a, b


def _json(report: DiffReport) -> dict:
    return {"equal": report.equal, "tensors": report.tensors, "by_checksum": report.by_checksum,
            "bytes_read": report.bytes_read, "plain_values": report.plain_values,
            "differences": [asdict(d) for d in report.differences],
            "dtype_differences": [asdict(d) for d in report.dtype_differences],
            "metadata_differences": [asdict(d) for d in report.metadata_differences], "notes": report.notes}


def _print(report: DiffReport) -> None:
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
    if report.dtype_differences:
        shown = ", ".join(f"{d.name} ({d.detail})" for d in report.dtype_differences[:3])
        more = f" and {len(report.dtype_differences) - 3} more" if len(report.dtype_differences) > 3 else ""
        print(f"dtypes differ, values compared within the tolerance: {shown}{more}")
    if report.metadata_differences:
        print("file metadata differs (not tensor data): " + "; ".join(
            f"{d.name.split('.', 1)[1]}: {d.detail}" for d in report.metadata_differences))
    for note in report.notes:
        print(f"note: {note}")
