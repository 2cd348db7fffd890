"""``shardckpt convert --format dcp`` against ``shardckpt convert`` (shardckpt output) on the same source (issue 37).

Workload: a transformer-shaped fp32 model with Adam state (``--gib`` GiB in all, default 0.5), saved with
``shardckpt.save`` and converted once to a SHARDED checkpoint of 4 ranks, the source of both methods. Each
repeat runs, alternating (the order flipping from repeat to repeat), each as a subprocess timed from spawn to
exit (start-up included), the output removed and ``sync`` before each:

- ``shardckpt``: ``shardckpt convert SRC OUT --world-size 3 --quiet``;
- ``dcp``: ``shardckpt convert SRC OUT --world-size 3 --format dcp --quiet``.

Reported: medians (and minimums) of wall time and of each run's peak RSS (``ru_maxrss`` from ``wait4``), and the
ratio dcp / shardckpt of the medians. The DCP output of the last repeat is read back with torch's
``dcp_to_torch_save`` and checked equal to the source's ``load_full`` (``--no-check`` skips it).

    python benchmarks/bench_convert_dcp.py --repeats 3 [--gib 0.5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

GIB = 1 << 30


def state(gib: float) -> dict:
    """Layers of (4h x h) and (h x 4h) weights plus Adam's two moments, about ``gib`` GiB of fp32."""
    hidden, g = 1024, torch.Generator().manual_seed(0)
    layers = max(1, int(gib * GIB / 4 / 3 / (8 * hidden * hidden)))
    model = {f"layers.{i}.{n}": torch.randn(shape, generator=g) for i in range(layers)
             for n, shape in (("up.weight", (4 * hidden, hidden)), ("down.weight", (hidden, 4 * hidden)))}
    optim = {"state": {k: {"step": torch.tensor(10.0), "exp_avg": torch.randn(v.shape, generator=g),
                           "exp_avg_sq": torch.rand(v.shape, generator=g)} for k, v in model.items()},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(model)}]}
    return {"model": model, "optim": optim}


# A small launcher reports its child's peak RSS: a child forked straight from this process would report this
# process's (the state it built) when larger, its hiwater inherited at the fork.
LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds (the launcher's start included) and peak RSS bytes of ``cmd``."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"{cmd} failed: {done.stderr[-2000:]}")
    return wall, int(done.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import shardckpt

    base = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    src = os.path.join(base, "src")
    shardckpt.save(state(args.gib), os.path.join(base, "full"))
    shardckpt.convert(os.path.join(base, "full"), src, world_size=4)
    shutil.rmtree(os.path.join(base, "full"))
    cli = [os.path.join(os.path.dirname(sys.executable), "shardckpt"), "convert", src]
    methods = {"shardckpt": [], "dcp": ["--format", "dcp"]}
    results: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
    for repeat in range(args.repeats):
        for name in (list(methods) if repeat % 2 == 0 else list(reversed(methods))):
            out = os.path.join(base, name)
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            results[name].append(timed([*cli, out, "--world-size", "3", "--quiet", *methods[name]]))
    summary = {name: {"wall_s": sorted(w for w, _ in runs), "peak_rss_mib": sorted(r >> 20 for _, r in runs)}
               for name, runs in results.items()}
    med = {name: s["wall_s"][len(s["wall_s"]) // 2] for name, s in summary.items()}
    summary["ratio_dcp_to_shardckpt"] = med["dcp"] / med["shardckpt"]
    summary["tensor_gib"] = sum(t.nbytes for t in shardckpt.load_full(src, verify_checksums=False)["model"].values()) \
        * 3 / GIB
    summary["loadavg"] = os.getloadavg()
    if not args.no_check:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(os.path.join(base, "dcp"), os.path.join(base, "dcp.pt"))
        got, want = torch.load(os.path.join(base, "dcp.pt")), shardckpt.load_full(src)
        summary["dcp_equals_source"] = all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    shutil.rmtree(base)


if __name__ == "__main__":
    main()
