"""What a killed ``shardckpt convert`` saves on its rerun (issue 34, defect 14): straight run time, and the rerun
time after a kill -9 at 30 / 60 / 90 % of the work, as ratios to the straight run.

Workload: a transformer-shaped fp32 model with Adam state (``--gib`` GiB in all, default 1), saved as a
SHARDED shardckpt checkpoint at world size 4 (``convert`` of a one-process save, untimed), converted to world
size 3 by ``convert(SRC, DST, world_size=3, workers=W)`` in a ``python -c`` subprocess (what ``shardckpt convert
SRC DST --world-size 3 --workers W`` runs; it prints the report: the bytes kept), for each ``--workers`` asked (1: one process writing two files at a time, one output rank after another; 3: the
three output ranks all in flight at once, the case where keeping only whole ranks kept nothing).

Each repeat, per mode: a straight run into an empty destination; then, for each kill point X, a run into
another empty destination killed (SIGKILL to its process group) once X of the straight run's data bytes are
in its files (polled every 10 ms: the kill lands a little later; when in its run it landed is reported, as
a fraction of the straight time), and the same command run again (the rerun, timed), which must commit and
report what it kept. A kill at X % of the wall time would mostly hit the start-up here (Python and torch
take 3-6 s of an 8-10 s run on this loaded 2-core machine), so the points are fractions of the work. Before
every timed run: ``sync`` and the page cache dropped (root; else a warning), so that the source and what the
rerun reads back of the killed run's files come from the disk, as after a crash (``--warm``: no drop before
the rerun, as after a kill -9 on a machine that stays up). Every rerun's output is checked ``diff``-equal to
the source once per kill point. Reported: medians over the repeats of the wall time (start-up included) and
of ``convert()``'s own time (timed inside the process: the work, with the workers' start-up for W > 1), and
their ratios rerun / straight.

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
CONVERT = ("import sys, time; from shardckpt.offline.convert import convert; t = time.perf_counter(); "
           "r = convert(sys.argv[1], sys.argv[2], world_size=3, workers=int(sys.argv[3])); "
           "print(time.perf_counter() - t, r.kept_bytes, r.bytes_written)")
POINTS = (0.3, 0.6, 0.9)


def build_source(root: str, gib: float) -> str:
    """A SHARDED ws-4 checkpoint of a model + Adam state of ``gib`` GiB (built once, kept across runs)."""
    import shardckpt
    from bench_save_load import model_shapes
    from shardckpt.offline.convert import convert

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
    return [sys.executable, "-c", CONVERT, src, dst, str(workers)]


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """(wall s, convert()'s own s, bytes kept) of one run of ``cmd``."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({done.returncode}): {done.stderr[-2000:]}")
    inside, kept, _ = done.stdout.split()
    return seconds, float(inside), int(kept)


def data_bytes(dst: str) -> int:
    """The bytes in the data files under ``dst`` now."""
    total = 0
    for d in (os.listdir(dst) if os.path.isdir(dst) else []):
        folder = os.path.join(dst, d)
        if d.startswith("data-") and os.path.isdir(folder):
            for name in os.listdir(folder):
                if name.endswith(".bin"):
                    try:
                        total += os.path.getsize(os.path.join(folder, name))
                    except FileNotFoundError:
                        pass
    return total


def killed_after_bytes(cmd: list[str], dst: str, nbytes: int) -> float | None:
    """Run ``cmd`` and kill -9 its process group once ``nbytes`` are in its data files; the seconds after its
    start the kill came, or None if it committed first."""
    t0 = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while process.poll() is None and data_bytes(dst) < nbytes:
        time.sleep(0.01)
    if process.poll() is not None:
        return None
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return None if os.path.exists(os.path.join(dst, "manifest.json")) else time.perf_counter() - t0


def run_mode(src: str, root: str, workers: int, repeats: int, warm: bool, checked: set) -> dict:
    from shardckpt.offline.diff import diff

    straight: list = []
    reruns: dict = {x: [] for x in POINTS}
    for repeat in range(repeats):
        dst = os.path.join(root, f"dst-w{workers}")
        remove(dst)
        _cold()
        straight.append(timed(command(src, dst, workers)))
        total = data_bytes(dst)
        print(f"  w{workers} repeat {repeat}: straight {straight[-1][0]:.2f} s, convert() {straight[-1][1]:.2f} s "
              f"(load {loadavg()})", flush=True)
        for x in POINTS:
            remove(dst)
            _cold()
            at = killed_after_bytes(command(src, dst, workers), dst, int(x * total))
            if at is None:
                print(f"    kill at {x:.0%}: the run committed first; skipped", flush=True)
                continue
            if not warm:
                _cold()
            run = timed(command(src, dst, workers))
            reruns[x].append(run + (at,))
            print(f"    kill at {x:.0%} of the bytes ({at:.2f} s in): rerun {run[0]:.2f} s, convert() {run[1]:.2f} s, "
                  f"kept {run[2] / 2**20:.0f} of {total / 2**20:.0f} MiB", flush=True)
            if (workers, x) not in checked:
                assert diff(src, dst).equal, f"the rerun after a kill at {x:.0%} differs from the source"
                checked.add((workers, x))
        remove(dst)
    return {"straight": straight, "reruns": {str(x): v for x, v in reruns.items()}}


def report(results: dict, gib: float, warm: bool) -> None:
    print(f"\n{gib:g} GiB, SHARDED ws 4 -> 3, rerun {'warm' if warm else 'cold'}; medians (wall s / convert() s)")
    print("| mode | straight | kill at (of the bytes; of the time) | kept | rerun | rerun / straight (wall; convert()) |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        wall, inside = median([s[0] for s in r["straight"]]), median([s[1] for s in r["straight"]])
        for x, runs in r["reruns"].items():
            if runs:
                rw, ri, kept, at = (median([run[i] for run in runs]) for i in range(4))
                print(f"| {mode} | {wall:.2f} / {inside:.2f} | {float(x):.0%}; {at / wall:.0%} | {kept / 2**20:.0f} MiB | "
                      f"{rw:.2f} / {ri:.2f} | {rw / wall:.2f}; {ri / inside:.2f} (ideal {1 - float(x):.2f}) |")


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
