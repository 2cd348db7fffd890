"""DeepSpeed ZeRO checkpoints as input (issue 15): ``shardckpt export`` and ``convert`` against DeepSpeed's own
``zero_to_fp32``, cold, time and peak RSS.

Workload: a ZeRO-3 checkpoint of 4 data-parallel ranks, ``--gib`` GiB of fp32 parameters (default 0.5; 24
transformer-shaped matrices and their biases) with AdamW's ``exp_avg``/``exp_avg_sq``, so 3x that in the rank
files, in DeepSpeed's layout (``tests/formats/_deepspeed_layout.py``: the layout of the real DeepSpeed fixtures,
which ``zero_to_fp32`` reads too). Methods, each a subprocess timed from spawn to exit, page cache dropped
before each (root), medians of ``--repeats``:

- ``export``: ``shardckpt export SRC OUT`` (the fp32 weights as safetensors, default 512 MiB memory limit);
- ``zero_to_fp32``: DeepSpeed's ``python -m deepspeed.utils.zero_to_fp32 SRC OUT --safe_serialization``, with
  the Python given by ``--deepspeed-python`` (DeepSpeed is not a dependency; see ``fixtures/deepspeed/README.md``);
  skipped without it;
- ``convert``: ``shardckpt convert SRC DST --world-size 3`` (weights and optimizer state, no peer: DeepSpeed
  has no offline equivalent).

The exports are checked equal, tensor by tensor, bit for bit. Peak RSS: each process's own ``ru_maxrss``.

    python benchmarks/bench_deepspeed.py --deepspeed-python /tmp/dsenv/bin/python --repeats 3
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import drop_caches, median, remove  # noqa: E402
from shardckpt.demo.processes import run_measured  # noqa: E402
from tests.formats._deepspeed_layout import write_like_deepspeed  # noqa: E402

MIB = 1 << 20


def make_checkpoint(root: str, gib: float) -> None:
    dim = int((gib * (1 << 30) / 4 / 24) ** 0.5)
    g = torch.Generator().manual_seed(0)
    params = {}
    for i in range(24):
        params[f"layers.{i}.weight"] = torch.randn(dim, dim, generator=g)
        params[f"layers.{i}.bias"] = torch.randn(dim, generator=g)
    write_like_deepspeed(os.path.join(root, "global_step1"), 3, 4, [params], cut_subgroups=False)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step1")


def timed(cmd: list[str]) -> tuple[float, int]:
    drop_caches()
    start = time.perf_counter()
    with open(os.devnull, "w") as out:
        rc, rss, _ = run_measured(cmd, out, subprocess.STDOUT)
    elapsed = time.perf_counter() - start
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}")
    return elapsed, rss


def same_exports(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    def tensors(d: str) -> dict:
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/bench_deepspeed")
    parser.add_argument("--deepspeed-python", default=None)
    args = parser.parse_args()
    src = os.path.join(args.dir, "src")
    remove(args.dir)
    make_checkpoint(src, args.gib)
    files = sum(os.path.getsize(f) for f in glob.glob(os.path.join(src, "global_step1", "*")))
    print(f"ZeRO-3 checkpoint, 4 ranks: {args.gib} GiB of fp32 parameters, {files / 2**30:.2f} GiB of rank files")
    cli = [sys.executable, "-m", "shardckpt.cli.main"]
    methods = {
        "export": lambda out: cli + ["export", src, out, "--quiet"],
        "convert": lambda out: cli + ["convert", src, out, "--world-size", "3", "--quiet"],
    }
    if args.deepspeed_python:
        methods["zero_to_fp32"] = lambda out: [args.deepspeed_python, "-m", "deepspeed.utils.zero_to_fp32", src, out,
                                               "--safe_serialization"]
    results: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
    for repeat in range(args.repeats):
        for name, cmd in methods.items():
            out = os.path.join(args.dir, f"{name}-{repeat}")
            results[name].append(timed(cmd(out)))
            if repeat:
                remove(out)
    if args.deepspeed_python:
        print(f"exports equal to zero_to_fp32's, bit for bit: {same_exports(os.path.join(args.dir, 'export-0'), os.path.join(args.dir, 'zero_to_fp32-0'))}")
    for name, runs in results.items():
        times, peaks = [t for t, _ in runs], [r for _, r in runs]
        print(f"{name:>13}: {median(times):6.2f} s (min {min(times):.2f}), peak RSS {median(peaks) / MIB:6.0f} MiB")
    if "zero_to_fp32" in results:
        ds = median([t for t, _ in results["zero_to_fp32"]])
        ex = median([t for t, _ in results["export"]])
        print(f"export / zero_to_fp32 time: {ex / ds:.2f}x; peak RSS: "
              f"{median([r for _, r in results['export']]) / median([r for _, r in results['zero_to_fp32']]):.2f}x")


if __name__ == "__main__":
    main()
