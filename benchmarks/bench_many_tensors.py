"""Per-tensor overhead: one process, many small tensors, side by side in one run (issue 38, item 1).

Workload (default): a mixture-of-experts shape, 128 experts x 25 layers, each expert holding four small
fp32 matrices (8 x 16), plus an Adam moment (same shape) for half of them: 12,800 + 6,400 = 19,200 tensors,
~9.8 MB, as one flat dict of dotted names.

Methods, their order rotating from repeat to repeat, medians of ``--repeats``:

- save: ``shardckpt.save``; ``torch.save`` + fsync; ``dcp.save`` (``FileSystemWriter``, no process group;
  it fsyncs itself); safetensors ``save_file`` + fsync.
- load: ``shardckpt.load_full``; ``shardckpt.load`` into preallocated tensors; ``torch.load``
  (``weights_only``, ``mmap``); ``dcp.load`` into preallocated tensors; safetensors ``load_file``.
- async: the time ``AsyncSaver.save`` blocks the caller (steady state: one saver, a first save untimed),
  beside ``torch.save`` + fsync of the same state.
- convert: ``shardckpt.convert`` of the shardckpt checkpoint to world size 2, beside ``torch.load`` then
  ``torch.save`` + fsync (the same bytes read and written by torch).

Reported: medians, each as a ratio to its peer measured in the same run, and shardckpt's cost per tensor
(its median / tensors). The page cache is not dropped (this measures per-tensor CPU work, not the disk).

    python benchmarks/bench_many_tensors.py                 # 19,200 tensors, 3 repeats (~1-2 min)
    python benchmarks/bench_many_tensors.py --experts 16    # 2,400 tensors, quicker
    python benchmarks/bench_many_tensors.py --manifest 100000   # + parse and plan a 100k-tensor manifest
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import fsync_path, loadavg, median, remove, verdict

import shardckpt

SAVES = ("shardckpt", "torch", "dcp", "safetensors")
LOADS = ("shardckpt_full", "shardckpt_into", "torch", "dcp", "safetensors")


def make_state(experts: int, layers: int, rows: int = 8, cols: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for e in range(experts):
            for k in ("w1", "w2", "w3", "gate"):
                sd[f"model.layers.{layer}.experts.{e}.{k}"] = torch.randn(rows, cols, generator=g)
    for i, name in enumerate(list(sd)):
        if i % 2 == 0:
            sd[name.replace("model.", "optim.", 1) + ".exp_avg"] = torch.randn(rows, cols, generator=g)
    return sd


def _dcp():
    import torch.distributed.checkpoint as dcp
    return dcp


def save_with(method: str, sd: dict, path: str) -> None:
    if method == "shardckpt":
        shardckpt.save(sd, path)
    elif method == "torch":
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
    elif method == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _dcp().save(sd, storage_writer=_dcp().FileSystemWriter(path))
    else:
        from safetensors.torch import save_file
        save_file(sd, path)
        fsync_path(path)


def load_with(method: str, paths: dict, targets: dict) -> object:
    if method == "shardckpt_full":
        return shardckpt.load_full(paths["shardckpt"])
    if method == "shardckpt_into":
        return shardckpt.load(targets, paths["shardckpt"])
    if method == "torch":
        return torch.load(paths["torch"], mmap=True, weights_only=True)
    if method == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _dcp().load(targets, storage_reader=_dcp().FileSystemReader(paths["dcp"]))
    from safetensors.torch import load_file
    return load_file(paths["safetensors"])


def _measure(res: dict, kind: str, method: str, fn) -> object:
    """Run ``fn``; record its wall time under ``res[kind][method]`` and this process's CPU time (all threads)
    under ``res["cpu " + kind][method]``: on a loaded machine CPU time shows the per-tensor work more steadily."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    res[kind][method].append(time.perf_counter() - t0)
    res["cpu " + kind][method].append(time.process_time() - c0)
    return out


def _rotated(seq: tuple, rep: int) -> tuple:
    k = rep % len(seq)
    return seq[k:] + seq[:k]


def run(sd: dict, base: str, repeats: int) -> dict:
    paths = {"shardckpt": os.path.join(base, "sc"), "torch": os.path.join(base, "t.pt"),
             "dcp": os.path.join(base, "dcp"), "safetensors": os.path.join(base, "s.safetensors")}
    kinds = {"save": SAVES, "load": LOADS, "async": ("shardckpt", "torch"), "convert": ("shardckpt", "torch")}
    res: dict = {k: {m: [] for m in ms} for k, ms in kinds.items()}
    res.update({"cpu " + k: {m: [] for m in ms} for k, ms in kinds.items()})
    res["loadavg"] = []
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    saver = shardckpt.AsyncSaver()
    saver.save(sd, os.path.join(base, "async-warm")).wait()  # the staging buffers exist from then on
    for rep in range(repeats):
        res["loadavg"].append(loadavg())
        for m in _rotated(SAVES, rep):
            remove(paths[m])
            _measure(res, "save", m, lambda: save_with(m, sd, paths[m]))
        for m in _rotated(LOADS, rep):
            _measure(res, "load", m, lambda: load_with(m, paths, targets))
        for m in _rotated(kinds["async"], rep):
            dst = os.path.join(base, f"async-{m}")
            remove(dst)
            if m == "shardckpt":
                _measure(res, "async", m, lambda: saver.save(sd, dst)).wait()  # the wait is not timed
            else:
                _measure(res, "async", m, lambda: save_with("torch", sd, dst))
        for m in _rotated(kinds["convert"], rep):
            dst = os.path.join(base, f"conv-{m}")
            remove(dst)
            if m == "shardckpt":
                _measure(res, "convert", m, lambda: shardckpt.convert(paths["shardckpt"], dst, world_size=2))
            else:
                _measure(res, "convert", m, lambda: save_with(
                    "torch", torch.load(paths["torch"], mmap=True, weights_only=True), dst))
    saver.close()
    check = shardckpt.load_full(os.path.join(base, "conv-shardckpt"))
    assert all(torch.equal(check[k], v) for k, v in sd.items()), "shardckpt round trip differs"
    return res


def manifest_scale(n: int, base: str) -> dict:
    """Save ``n`` small tensors, then time (medians of 5) parsing the manifest and planning a read of every
    tensor whole (what ``load_full`` plans), in this process, with the collector paused as ``load`` pauses it."""
    from shardckpt.format.manifest import parse_manifest
    from shardckpt.formats.api import ReadRequest
    from shardckpt.formats.native.plan import plan_reads
    from shardckpt.formats.requests import check_requests
    from shardckpt.gc_pause import gc_paused
    from shardckpt.regions import FlatRange

    parse_manifest, plan = gc_paused(parse_manifest), gc_paused(lambda m, r, p: plan_reads(check_requests(m, r, p)))

    sd = {f"layers.{i // 128}.experts.{i % 128}.w": torch.full((4,), float(i)) for i in range(n)}
    path = os.path.join(base, "manifest-scale")
    remove(path)
    shardckpt.save(sd, path)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        data = f.read()
    parse_s, plan_s = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        manifest = parse_manifest(data, path)
        t1 = time.perf_counter()
        requests = [ReadRequest(name, FlatRange(0, e.numel), torch.empty(e.shape, dtype=e.dtype).reshape(-1))
                    for name, e in manifest.tensors.items()]
        t2 = time.perf_counter()
        plan(manifest.tensors, requests, path)
        parse_s.append(t1 - t0)
        plan_s.append(time.perf_counter() - t2)
    return {"parse": median(parse_s), "plan": median(plan_s), "manifest_bytes": len(data)}


def report(res: dict, n: int) -> list[tuple[str, float, bool]]:
    med = {k: {m: median(v) for m, v in d.items()} for k, d in res.items() if k != "loadavg"}
    s, ld, a, c = med["save"], med["load"], med["async"], med["convert"]
    print(f"{n} tensors; medians (s), loadavg {res['loadavg']}")
    for kind in ("save", "load", "async", "convert"):
        print(f"  {kind:8s} " + "  ".join(f"{m} {v:.3f}" for m, v in med[kind].items()))
        print("   (cpu)   " + "  ".join(f"{m} {v:.3f}" for m, v in med["cpu " + kind].items()))
    us = 1e6 / n
    print(f"  per tensor (us): save {s['shardckpt'] * us:.0f}, load_full {ld['shardckpt_full'] * us:.0f}, "
          f"load {ld['shardckpt_into'] * us:.0f}, async blocked {a['shardckpt'] * us:.0f}, "
          f"convert {c['shardckpt'] * us:.0f}")
    return [
        ("save / torch.save+fsync <= 1.5", s["shardckpt"] / s["torch"], s["shardckpt"] <= 1.5 * s["torch"]),
        ("dcp.save / save >= 3", s["dcp"] / s["shardckpt"], s["dcp"] >= 3 * s["shardckpt"]),
        ("save / safetensors+fsync", s["shardckpt"] / s["safetensors"], True),
        ("load_full / torch.load <= 1.5", ld["shardckpt_full"] / ld["torch"],
         ld["shardckpt_full"] <= 1.5 * ld["torch"]),
        ("load (into) / torch.load <= 1.5", ld["shardckpt_into"] / ld["torch"],
         ld["shardckpt_into"] <= 1.5 * ld["torch"]),
        ("dcp.load / load (into) >= 3", ld["dcp"] / ld["shardckpt_into"], ld["dcp"] >= 3 * ld["shardckpt_into"]),
        ("load_full / safetensors", ld["shardckpt_full"] / ld["safetensors"], True),
        ("async blocked / torch.save+fsync <= 1.5", a["shardckpt"] / a["torch"], a["shardckpt"] <= 1.5 * a["torch"]),
        ("convert / torch.load+save+fsync <= 1.5", c["shardckpt"] / c["torch"], c["shardckpt"] <= 1.5 * c["torch"]),
        ("cpu: save / torch.save+fsync", med["cpu save"]["shardckpt"] / med["cpu save"]["torch"], True),
        ("cpu: dcp.save / save", med["cpu save"]["dcp"] / med["cpu save"]["shardckpt"], True),
        ("cpu: load_full / torch.load", med["cpu load"]["shardckpt_full"] / med["cpu load"]["torch"], True),
        ("cpu: dcp.load / load (into)", med["cpu load"]["dcp"] / med["cpu load"]["shardckpt_into"], True),
        ("save per tensor (us) <= 20", s["shardckpt"] * us, s["shardckpt"] * us <= 20),
        ("load_full per tensor (us) <= 20", ld["shardckpt_full"] * us, ld["shardckpt_full"] * us <= 20),
        ("async blocked per tensor (us) <= 20", a["shardckpt"] * us, a["shardckpt"] * us <= 20),
        ("convert per tensor (us) <= 20", c["shardckpt"] * us, c["shardckpt"] * us <= 20),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--layers", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--manifest", type=int, default=0, help="also parse and plan a manifest of this many tensors")
    ap.add_argument("--json", default=None, help="write the raw timings here")
    args = ap.parse_args()
    sd = make_state(args.experts, args.layers)
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        res = run(sd, base, args.repeats)
        rows = report(res, len(sd))
        if args.manifest:
            res["manifest"] = manifest_scale(args.manifest, base)
            print(f"  manifest of {args.manifest} tensors: parse {res['manifest']['parse']:.3f} s, "
                  f"plan a full read {res['manifest']['plan']:.3f} s")
    for label, value, ok in rows:
        print(f"  {verdict(ok)}  {label}: {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
