"""``shardckpt convert SRC DST``: any readable checkpoint as a shardckpt checkpoint of another world size or type."""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, storage_options, usage_error
from shardckpt.cli.progress import Progress

from shardckpt.convert.convert import TYPES, convert
from shardckpt.convert.export import parse_size
from shardckpt.convert.memory import DEFAULT_MEMORY_LIMIT
from shardckpt.format.codecs import Compression

EPILOG = """sources: shardckpt checkpoints of any type and world size (LOCAL ones through their flat layouts),
torch DCP directories, safetensors files or Hugging Face directories, torch.save files. The output is a
shardckpt checkpoint, committed atomically at the end: until then nothing at DST loads or verifies.
Chunks stream through a slice at a time, through 256 MiB of buffers by default, whatever the checkpoint's
size; --memory-limit bounds the whole process instead (Python and torch take ~265 MiB of it). Rerun after a kill, the same
command keeps the output ranks already finished (for a shardckpt source). Started by torchrun, the copies
share the writing (output rank r is written by copy r % nproc; copy 0 commits): on one machine, or on
several that see the same SRC and DST (a shared file system, or object storage).

examples:
  shardckpt convert /ckpt/step-1000 /ckpt/step-1000-ws8 --world-size 8
  shardckpt convert /ckpt/local-step-1000 /export/full --type full --world-size 1 --only model
  shardckpt convert /ckpt/step-1000 /archive/step-1000 --compress zstd      (bf16 ~1.45x smaller)
  shardckpt convert /dcp/step-500 s3://bucket/step-500 --world-size 4 -o endpoint_url=http://127.0.0.1:9000
  torchrun --nproc-per-node 4 -m shardckpt.cli.main convert s3://b/step-1000 s3://b/step-1000-ws64 --world-size 64
"""


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint to another world size, type or dtype",
                       description="Write SRC (any readable format) as a shardckpt checkpoint at DST.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="source checkpoint, file or fsspec URL")
    p.add_argument("dst", help="destination directory or fsspec URL")
    p.add_argument("--world-size", type=_positive, help="output world size (default: the source's, 1 for other formats)")
    p.add_argument("--type", choices=TYPES, help="output state-dict type (default: the source's)")
    p.add_argument("--optim-key", choices=("name", "id"),
                   help="key the optimizer state by parameter name or ID (default: as the source does)")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--only", nargs="+", default=(), metavar="PREFIX", help="keep only these dotted-name prefixes")
    p.add_argument("--exclude", nargs="+", default=(), metavar="PREFIX", help="leave out these prefixes")
    p.add_argument("--compress", type=usage_error(Compression.parse), metavar="zstd[:LEVEL]",
                   help="store chunks as zstd frames (floats split into byte planes first); default: raw")
    p.add_argument("--memory-limit", type=usage_error(parse_size), default=DEFAULT_MEMORY_LIMIT, metavar="SIZE",
                   help="resident memory of this process at most about SIZE, e.g. 1GiB: what the process holds "
                        "already is spent first, the rest is the buffers chunks stream through (default: no "
                        "limit, 256 MiB of buffers)")
    p.add_argument("--workers", type=_positive, default=1, metavar="N",
                   help="spread the output files over N local processes (each within --memory-limit)")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_options(p)
    p.set_defaults(run=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"--dtype {name!r}: expected a floating-point torch dtype, e.g. bfloat16")
    return dtype


def run(args: argparse.Namespace) -> int:
    options = storage_options(args)
    with _torchrun_workers() as workers:  # None unless started by torchrun with more than one process
        leader = workers is None or dist.get_rank() == 0
        if workers is not None and args.workers > 1:
            raise argparse.ArgumentTypeError("--workers: under torchrun, its processes are the workers")
        progress = Progress("convert", quiet=args.quiet or not leader)
        try:
            report = convert(args.src, args.dst, world_size=args.world_size, type=args.type, dtype=_dtype(args.dtype),
                             only=args.only, exclude=args.exclude, overwrite=args.overwrite, storage_options=options,
                             dst_storage_options=options, compress=args.compress, progress=progress,
                             spread_over=workers, memory_limit=args.memory_limit,
                             optim_key=args.optim_key, workers=args.workers)
        finally:
            progress.close()
    if leader and not args.quiet:
        count = workers.size() if workers is not None else args.workers
        spread = f", written by {count} workers" if count > 1 else ""
        if report.kept_bytes:  # checked block by block against their CRCs before they were kept
            spread += f", {report.kept_bytes} bytes kept from a killed run ({len(report.kept_ranks)} ranks whole)"
        print(f"{args.dst}: {report.type} checkpoint at world size {report.world_size}, {report.tensors} tensors, "
              f"{report.bytes_written} bytes{spread}")
    return 0


@contextlib.contextmanager
def _torchrun_workers():
    """The default process group (gloo), when torchrun started several copies of this command; else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        yield None
        return
    dist.init_process_group("gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
