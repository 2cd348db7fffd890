"""``shardckpt export SRC DST``: the model weights of any readable checkpoint as Hugging Face style safetensors."""
from __future__ import annotations

import argparse
import time

from shardckpt.cli.options import STORAGE_HELP, add_rename_map, add_storage_options, storage_options, usage_error
from shardckpt.cli.progress import Progress
from shardckpt.cli.run_dirs import add_latest, explaining_run_dirs, resolve

from shardckpt.convert.export import DEFAULT_MAX_SHARD_SIZE, cast_dtype, export, parse_size, slice_bytes_for

EPILOG = """sources: shardckpt checkpoints of any type and world size (LOCAL ones by parameter name), torch DCP
directories, safetensors files or Hugging Face directories, torch.save files. Exported: the `model` entry of a
training checkpoint (names relative to it), else every tensor outside `optim`/`optimizer`; --only picks other
entries. Wrapper prefixes `module.` and `_orig_mod.` are removed; tied weights (LOCAL) are written once.
Output: model.safetensors, or model-0000i-of-0000N.safetensors and model.safetensors.index.json (written last;
a rerun after a kill keeps the files it had finished, for a shardckpt source),
streamed in slices of at most 64 MiB (two buffers), whatever the model's size; --memory-limit bounds the
process's resident memory instead (e.g. 512MiB: ~265 MiB of Python and torch, the rest buffers).

examples:
  shardckpt export /ckpt/step-1000 /export/step-1000 --dtype bfloat16
  shardckpt export runs/example /export/latest --latest   (the latest committed step-* below a run directory)
  shardckpt export /ckpt/step-1000 s3://bucket/model --max-shard-size 2GB -o endpoint_url=http://127.0.0.1:9000
  shardckpt export /dcp/step-500 /export/ema --only ema --strip-prefix ema.
  shardckpt export /ckpt/step-1000 /export/hf --rename-map llama-names.json --memory-limit 1GiB
    with llama-names.json: {"tok\\.weight": "model.embed_tokens.weight",
                            "blocks\\.(\\d+)\\.attn\\.(q|k|v)\\.weight": "model.layers.\\1.self_attn.\\2_proj.weight",
                            "rope\\..*": null}
"""


def register(sub) -> None:
    p = sub.add_parser("export", help="export the model weights as Hugging Face style safetensors",
                       description="Write the model weights of SRC (any readable format) as safetensors files in DST.",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="source checkpoint, file or fsspec URL")
    p.add_argument("dst", help="destination directory or fsspec URL")
    p.add_argument("--dtype", default="keep", type=usage_error(cast_dtype),
                   help="bfloat16, float16, float32 or keep (default): cast floating-point tensors")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, type=usage_error(parse_size), metavar="SIZE",
                   help="tensor bytes per file at most, e.g. 5GB (default), 500MiB")
    p.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                   help="export these dotted-name prefixes instead of the model weights")
    p.add_argument("--strip-prefix", metavar="P", help="remove this prefix from the exported names")
    add_rename_map(p, "rename the exported tensors: ")
    p.add_argument("--memory-limit", type=usage_error(parse_size), metavar="SIZE",
                   help="resident memory of this process at most about SIZE, e.g. 1GiB: what the process holds "
                        "already (~265 MiB of Python and torch) is spent first, the rest is the read and cast "
                        "buffers (default: two of 64 MiB); a source's reader may hold one stored chunk more (a "
                        "DCP chunk, when verified)")
    add_latest(p, "SRC")
    p.add_argument("--overwrite", action="store_true", help="replace an export at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    add_storage_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = storage_options(args)
    src = resolve(args, args.src)
    progress = Progress("export", quiet=args.quiet)
    start = time.monotonic()
    try:
        with explaining_run_dirs(args, src):
            report = export(src, args.dst, dtype=args.dtype, max_shard_size=args.max_shard_size, only=args.only,
                            strip_prefix=args.strip_prefix, overwrite=args.overwrite, storage_options=options,
                            dst_storage_options=options, progress=progress, rename=args.rename_map,
                            **({} if args.memory_limit is None else {"slice_bytes": slice_bytes_for(args.memory_limit)}))
    finally:
        progress.close()
    if not args.quiet:
        tied = f", {len(report.tied)} tied left out" if report.tied else ""
        tied += f", {len(report.kept)} finished files of a killed export kept" if report.kept else ""
        print(f"{args.dst}: {len(report.files)} file{'s' if len(report.files) > 1 else ''}, {report.tensors} tensors"
              f"{tied}, {report.total_size} bytes, dtype {report.dtype}, {time.monotonic() - start:.1f} s")
    return 0
