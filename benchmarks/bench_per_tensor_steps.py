"""Per-tensor cost of save, load_full, load (and convert) in one process, and of save's three steps (issue 38, item 1).

``bench_many_tensors.py`` times each method once per repeat beside its peers; on a shared machine one sample of a
half-second call moves by 20 % or more. This one repeats the calls many times in one warm process (save, then
load_full, then load into tensors, in turn) and reports medians per tensor, so that two versions run in alternating
processes can be compared to a few percent. It also times the save's steps (``stage``, ``plan``, ``persist``: the
public ``shardckpt.checkpoint.save`` steps) one after another, as a caller of the steps (an async save) runs them:
``stage`` pauses Python's cyclic collector as ``save`` does, ``plan`` and ``persist`` run with it on (an async save
runs them in its background thread, where a pause would stop collection for the whole process: shardckpt.gc_pause),
and ``plan`` is made afresh each time (``save`` reuses the last plan while the pieces are the same), so the steps add
up to more than one ``save``.

Workload: ``bench_many_tensors.make_state`` (default 128 experts x 25 layers: 19,200 small fp32 tensors, ~10 MB).
Each save replaces the previous one (``overwrite=True``), as a training loop's saves do.

    python benchmarks/bench_per_tensor_steps.py                  # 11 repeats (~30 s)
    python benchmarks/bench_per_tensor_steps.py --calls-only     # the three calls alone (no steps), ~15 s
    python benchmarks/bench_per_tensor_steps.py --calls-only --convert   # and a convert to world size 2 in turn
    PYTHONPATH=<other checkout>/src python benchmarks/bench_per_tensor_steps.py   # the same for another version
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import loadavg
from bench_many_tensors import make_state

import shardckpt
from shardckpt.checkpoint.save import persist, plan, stage


def _timed(samples: dict, key: str, fn) -> object:
    t0 = time.perf_counter()
    out = fn()
    samples.setdefault(key, []).append(time.perf_counter() - t0)
    return out


def measure(state: dict, path: str, repeats: int, steps: bool = True, convert: bool = False) -> dict[str, list[float]]:
    """Wall times of every call, by name: the whole calls in turn (``convert``: with a convert of the checkpoint to
    world size 2, into a directory emptied before each), then (``steps``) the save's steps."""
    converted = f"{path}-ws2"
    shardckpt.save(state, path)  # warm: the first save also creates the directory and imports what it needs
    targets = {name: torch.empty_like(t) for name, t in state.items()}
    shardckpt.load(targets, path)
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        _timed(samples, "save", lambda: shardckpt.save(state, path, overwrite=True))
        _timed(samples, "load_full", lambda: shardckpt.load_full(path))
        _timed(samples, "load", lambda: shardckpt.load(targets, path))
        if convert:
            shutil.rmtree(converted, ignore_errors=True)
            _timed(samples, "convert (to world size 2)", lambda: shardckpt.convert(path, converted, world_size=2))
    for _ in range(repeats if steps else 0):
        staged = _timed(samples, "save: stage", lambda: stage(state))
        planned = _timed(samples, "save: plan", lambda s=staged: plan(s, path, overwrite=True))
        _timed(samples, "save: persist (write + commit)", lambda s=staged, p=planned: persist(s, p))
    differ = differing(state, shardckpt.load_full(path))
    if convert and not differ:
        differ = differing(state, shardckpt.load_full(converted))
    if differ:  # a benchmark of wrong results measures nothing
        raise AssertionError(f"{len(differ)} tensors did not load back bit for bit, e.g. {differ[0]!r}")
    return samples


def differing(state: dict, loaded: dict) -> list[str]:
    """The names of the tensors that did not come back bit for bit."""
    return [n for n, t in state.items() if n not in loaded or not torch.equal(loaded[n], t)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--layers", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--calls-only", action="store_true", help="time save, load_full and load only, not the steps")
    ap.add_argument("--convert", action="store_true", help="also time a convert to world size 2 in each turn")
    ap.add_argument("--json", help="write the raw samples here")
    args = ap.parse_args()
    state = make_state(args.experts, args.layers)
    with tempfile.TemporaryDirectory(prefix="shardckpt-steps-") as tmp:
        samples = measure(state, os.path.join(tmp, "ckpt"), args.repeats, steps=not args.calls_only,
                          convert=args.convert)
    print(f"{len(state):,} tensors, shardckpt from {os.path.dirname(shardckpt.__file__)}, loadavg {loadavg()}")
    print(f"medians (and minimums: the least disturbed call on a shared machine) of {args.repeats}, us per tensor:")
    for key, values in samples.items():
        print(f"  {key:32s} {statistics.median(values) * 1e6 / len(state):7.1f} ({min(values) * 1e6 / len(state):.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(state), "samples": samples}, f)


if __name__ == "__main__":
    main()
