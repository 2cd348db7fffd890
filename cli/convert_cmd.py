"""``shardckpt convert SRC DST``: any readable checkpoint as a shardckpt checkpoint of another world size or type
(``shardckpt.convert``; this module prints its result, and runs it spread over torchrun's copies)."""
from __future__ import annotations

import argparse

from shardckpt.api.results import ConvertResult
from shardckpt.sizes import format_bytes

EPILOG = """sources: shardckpt checkpoints of any type and world size (LOCAL ones through their flat layouts),
torch DCP directories, safetensors files or Hugging Face directories, torch.save files. The output is a
shardckpt checkpoint, committed atomically at the end: until then nothing at DST loads or verifies.
Chunks stream through a slice at a time: the process's memory stays within --memory-limit (default
512MiB, of which Python and torch take ~265 MiB), whatever the checkpoint's size. Rerun after a kill, the same
command keeps the output ranks already finished (for a shardckpt source). Started by torchrun, the copies
share the writing (output rank r is written by copy r % nproc; copy 0 commits): on one machine, or on
several that see the same SRC and DST (a shared file system, or object storage).

examples:
  shardckpt convert /ckpt/step-1000 /ckpt/step-1000-ws8 --world-size 8
  shardckpt convert /ckpt/local-step-1000 /export/full --type full --world-size 1 --only model --only optim
  shardckpt convert /ckpt/step-1000 /archive/step-1000 --compress zstd      (bf16 ~1.45x smaller)
  shardckpt convert /dcp/step-500 s3://bucket/step-500 --world-size 4 -o endpoint_url=http://127.0.0.1:9000
  torchrun --nproc-per-node 4 -m shardckpt.cli.main convert s3://b/step-1000 s3://b/step-1000-ws64 --world-size 64
  shardckpt convert hf/llama /ckpt/start --world-size 8 --type sharded --adapter hf   (HF weights under `model`:
      a run's first checkpoint, for load_state(model, None, path) or load({"model": sd}, path))
  shardckpt convert hf/llama /ckpt/titan-start --world-size 8 --type sharded --reverse
      --adapter torchtitan-llama:config=hf/llama        (in torchtitan's names and q/k layout)
  shardckpt convert /ckpt/step-1000 titan/checkpoint/step-1000 --format dcp --only model --strip-prefix model.
      (a save({"model": sd}) as torchtitan's CheckpointManager loads it: flat model keys)
"""


def call(function, kwargs: dict, args: argparse.Namespace) -> ConvertResult | None:
    """``convert``, its writing shared by torchrun's copies when torchrun started several (the first reports)."""
    from shardckpt.dist.group import resolve_group  # not at import: `--help` answers without torch
    from shardckpt.dist.world import torchrun_world

    with torchrun_world() as workers:  # None unless started by torchrun with more than one process
        if workers is None:
            return function(**kwargs)
        if kwargs.get("workers", 1) > 1:
            raise argparse.ArgumentTypeError("--workers: under torchrun, its processes are the workers")
        first = resolve_group(workers).rank == 0
        if not first:
            kwargs.pop("progress", None)
        result = function(**kwargs, spread_over=workers)
        return result if first else None


def show(result: ConvertResult, args: argparse.Namespace) -> None:
    if args.quiet or args.json:
        return
    spread = f", written by {result.workers} workers" if result.workers > 1 else ""
    if result.kept_bytes:  # checked block by block against their CRCs before they were kept
        spread += (f", {format_bytes(result.kept_bytes)} kept from a killed run ({len(result.kept_ranks)} ranks "
                   "whole)")
    kind = "torch DCP" if result.format == "dcp" else result.type
    print(f"{result.path}: {kind} checkpoint at world size {result.world_size}, {result.tensors} tensors, "
          f"{format_bytes(result.tensor_bytes)} of tensor data written{spread}, {result.seconds:.1f} s")

