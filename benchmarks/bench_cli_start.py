"""How fast ``shardckpt --help`` and every ``shardckpt VERB --help`` answer: wall and CPU time (median of
``--repeats`` runs, each a fresh interpreter), peak RSS, and whether torch was imported.

CPU time (user + sys of the child) is the figure to compare on a shared machine: wall time there includes
waiting for a core. ``--tree DIR`` runs another copy of the sources instead (a directory holding a
``shardckpt`` package with its ``cli`` inside, e.g. an old commit's ``src/shardckpt`` + ``cli``), for a
before/after table:

    .venv/bin/python benchmarks/bench_cli_start.py [--repeats 5] [--tree /tmp/before/pkg] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VERBS = ("inspect", "verify", "convert", "export", "diff", "gc", "latest", "demo")
PROBE = ("import sys; sys.argv[0] = 'shardckpt'; from shardckpt.cli.main import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print('torch' in sys.modules, file=sys.stderr)")


def measure(argv: list[str], tree: str | None) -> dict | None:
    env = dict(os.environ, **({"PYTHONPATH": tree} if tree else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if "invalid choice" in done.stderr:
        return None  # a verb this tree does not have
    if done.returncode != 0 or "usage:" not in done.stdout:
        sys.exit(f"{argv}: exit {done.returncode}: {done.stderr[-500:]}")
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "torch": done.stderr.strip().splitlines()[-1] == "True"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tree", help="PYTHONPATH holding the shardckpt package to time (default: the installed one)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = {}
    for argv in [["--help"]] + [[verb, "--help"] for verb in VERBS]:
        if measure(argv, args.tree) is None:  # also the warm-up: byte-compile, page cache
            print(f"shardckpt {' '.join(argv):16s} (no such verb here)")
            continue
        runs = [measure(argv, args.tree) for _ in range(args.repeats)]
        rows[" ".join(argv)] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                                "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                                "torch_imported": any(r["torch"] for r in runs)}
        row = rows[" ".join(argv)]
        print(f"shardckpt {' '.join(argv):16s} wall {row['wall_s']:.3f} s  cpu {row['cpu_s']:.3f} s  "
              f"torch {'imported' if row['torch_imported'] else 'not imported'}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"peak RSS of one run: {peak / 1024:.0f} MiB; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "peak_rss_mib": peak / 1024, "load_average": os.getloadavg()[0]}, f, indent=2)


if __name__ == "__main__":
    main()
