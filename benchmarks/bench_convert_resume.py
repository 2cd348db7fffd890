"""What a killed ``shardckpt convert`` saves on its rerun (issue 34, defect 14): straight run time, and the rerun
time after a kill -9 at 30 / 60 / 90 % of the straight time, as ratios to the straight run.

Workload: a transformer-shaped fp32 model with Adam state (``--gib`` GiB in all, default 1), saved as a
SHARDED shardckpt checkpoint at world size 4 (``convert`` of a one-process save, untimed), converted to world
size 3 by ``.venv/bin/shardckpt convert SRC DST --world-size 3 --quiet [--workers W]`` as a subprocess, for
each ``--workers`` asked (1: one process writing two files at a time, one output rank after another; 3: the
three output ranks all in flight at once, the case where keeping only whole ranks kept nothing).

Each repeat, per mode: a straight run into an empty destination; then, for each kill point X, a run into
another empty destination killed (SIGKILL to its process group) X * (median straight time so far) after its
start, and the same command run again (the rerun, timed), which must commit and report what it kept. Before
every timed run: ``sync`` and the page cache dropped (root; else a warning), so that the source and what the
rerun reads back of the killed run's files come from the disk, as after a crash (``--warm``: no drop before
the rerun, as after a kill -9 on a machine that stays up). Every rerun's output is checked ``diff``-equal to
the source once per kill point. Reported: medians over the repeats; ratios rerun / straight; and the same
after taking away the start-up cost both pay (``python -c "import torch, shardckpt"``, measured alike).

    python benchmarks/bench_convert_resume.py --repeats 3 --json /tmp/bench/resume.json    # ~1 GiB (~10 min)
    python benchmarks/bench_convert_resume.py --quick                                     # 0.25 GiB, 1 repeat
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import can_drop_caches, drop_caches, loadavg, median, remove

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(os.path.dirname(sys.executable), "shardckpt")
POINTS = (0.3, 0.6, 0.9)


def build_source(root: str, gib: float) -> str:
    """A SHARDED ws-4 checkpoint of a model + Adam state of ``gib`` GiB (built once, kept across runs)."""
    import shardckpt
    from bench_save_load import model_shapes
    from shardckpt.convert.convert import convert

    src = os.path.join(root, f"src-{gib:g}")
    if os.path.exists(os.path.join(src, "manifest.json")):
        return src
    one = os.path.join(root, "one")
    remove(one)
    g = torch.Generator().manual_seed(0)
    shapes = model_shapes(gib / 3)
    state: dict = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 1e-3, "params": list(shapes)}]}}
    for name, shape in shapes.items():
        state["model"][name] = torch.randn(shape, generator=g)
        state["optim"]["state"][name] = {"step": 1000, "exp_avg": torch.randn(shape, generator=g),
                                         "exp_avg_sq": torch.rand(shape, generator=g)}
    shardckpt.save(state, one, metadata={"state_dict_type": "FULL_STATE_DICT"})
    del state
    convert(one, src, world_size=4, type="sharded")
    remove(one)
    return src


def _cold() -> None:
    subprocess.run(["sync"], check=True)
    if can_drop_caches():
        drop_caches()


def command(src: str, dst: str, workers: int) -> list[str]:
    return [CLI, "convert", src, dst, "--world-size", "3", "--quiet"] + (["--workers", str(workers)] if workers > 1
                                                                           else [])


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done.stdout


def killed_at(cmd: list[str], after_s: float) -> bool:
    """Run ``cmd`` and kill -9 its process group ``after_s`` seconds after its start; False if it ended first."""
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        process.wait(timeout=after_s)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return True


def startup_s() -> float:
    return timed([sys.executable, "-c", "import torch, shardckpt"])[0]


def run_mode(src: str, root: str, workers: int, repeats: int, warm: bool, checked: set) -> dict:
    from shardckpt.convert.diff import diff

    straight, reruns, startups = [], {x: [] for x in POINTS}, []
    for repeat in range(repeats):
        dst = os.path.join(root, f"dst-w{workers}")
        remove(dst)
        _cold()
        startups.append(startup_s())
        _cold()
        seconds, _ = timed(command(src, dst, workers))
        straight.append(seconds)
        print(f"  w{workers} repeat {repeat}: straight {seconds:.2f} s (load {loadavg()})", flush=True)
        for x in POINTS:
            remove(dst)
            _cold()
            if not killed_at(command(src, dst, workers), x * median(straight)):
                print(f"    kill at {x:.0%}: the run ended first; skipped", flush=True)
                continue
            if not warm:
                _cold()
            seconds, out = timed(command(src, dst, workers))
            reruns[x].append(seconds)
            print(f"    kill at {x:.0%}: rerun {seconds:.2f} s ({seconds / median(straight):.2f}x): {out.strip()}",
                  flush=True)
            if (workers, x) not in checked:
                assert diff(src, dst).equal, f"the rerun after a kill at {x:.0%} differs from the source"
                checked.add((workers, x))
        remove(dst)
    return {"straight_s": straight, "startup_s": startups, "rerun_s": {str(x): v for x, v in reruns.items()}}


def report(results: dict, gib: float, warm: bool) -> None:
    print(f"\n{gib:g} GiB, SHARDED ws 4 -> 3, rerun {'warm' if warm else 'cold'}; medians")
    print("| mode | straight s | start-up s | kill at | rerun s | rerun / straight | less start-up |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        s, up = median(r["straight_s"]), median(r["startup_s"])
        for x, v in r["rerun_s"].items():
            if v:
                rr = median(v)
                print(f"| {mode} | {s:.2f} | {up:.2f} | {float(x):.0%} | {rr:.2f} | {rr / s:.2f} | "
                      f"{(rr - up) / (s - up):.2f} (ideal {1 - float(x):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, action="append", help="convert --workers (repeatable; default 1 and 3)")
    parser.add_argument("--warm", action="store_true", help="keep the page cache before the rerun")
    parser.add_argument("--dir", default="/tmp/bench/resume")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.25, 1
    if not can_drop_caches():
        print("warning: cannot drop the page cache (not root): nothing is cold", file=sys.stderr)
    os.makedirs(args.dir, exist_ok=True)
    src = build_source(args.dir, args.gib)
    results, checked = {}, set()
    for workers in args.workers or [1, 3]:
        results[f"--workers {workers}"] = run_mode(src, args.dir, workers, args.repeats, args.warm, checked)
    report(results, args.gib, args.warm)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "warm": args.warm, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
