"""torch DCP with shardckpt's storage backend vs DCP with its own, side by side in one run, at world size 2 (issue 37).

Workload: ~``--gib`` GiB of fp32 transformer-shaped state (embedding, per layer attention and MLP up/down), each
rank holding the dim-0 half of every tensor as a DTensor ``Shard(0)`` (what FSDP2 gives DCP), plus a plain
``step``. The same DCP call for every method; only the storage layer differs:

- ``dcp1``: ``FileSystemWriter(path)`` / ``FileSystemReader(path)``, DCP's defaults (one writer thread);
- ``dcp2``: ``FileSystemWriter(path, thread_count=2)`` (as many threads as shardckpt's default files per rank);
- ``shardckpt``: ``shardckpt.dcp.StorageWriter(path)`` / ``StorageReader(path)`` (block checksums, verified
  on load, atomic commit);
- ``native`` (for reference, not DCP): shardckpt's own ``save``, ``async_save`` (reused staging buffers and
  plan) and ``load`` of the same state.

Per repeat, each method in turn (the order rotating from repeat to repeat): ``dcp.save`` (timed, the max over
ranks, fsync included: both sync their files); ``dcp.async_save``'s blocked time (until it returns; the save is
then waited for, untimed; a side gloo group, as torchtitan gives it); ``dcp.load`` into fresh DTensors, cold (page cache dropped when root). Medians over
``--repeats``; ratios to ``dcp1`` and ``dcp2`` measured in the same run.

    python benchmarks/bench_dcp_backend.py                # 0.5 GiB, 3 repeats (~3 min)
    python benchmarks/bench_dcp_backend.py --quick        # 128 MiB, 1 repeat
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import drop_caches, loadavg, median, spawn_gloo, verdict

METHODS = ("dcp1", "dcp2", "shardckpt", "native")
STEPS = ("save", "async_blocked", "load")


def shapes(gib: float) -> dict[str, tuple[int, int]]:
    d, out, total, i = 1024, {}, 0, 0
    budget = int(gib * (1 << 30))
    out["embed"] = (16384, d)
    total += 16384 * d * 4
    while total < budget:
        for name, shape in ((f"l{i}.attn", (4 * d, d)), (f"l{i}.up", (4 * d, d)), (f"l{i}.down", (d, 4 * d))):
            out[name] = shape
            total += shape[0] * shape[1] * 4
        i += 1
    return out


def _storage(method: str, path: str, load: bool):
    import torch.distributed.checkpoint as dcp

    from shardckpt.dcp import StorageReader, StorageWriter

    if method == "shardckpt":
        return StorageReader(path) if load else StorageWriter(path)
    if load:
        return dcp.FileSystemReader(path)
    return dcp.FileSystemWriter(path, thread_count=1 if method == "dcp1" else 2)


def _timed(dist, fn) -> float:
    """``fn``'s seconds, the max over ranks; dirty pages of earlier steps written back first (not timed), so that
    no step's fsync pays for another's writes."""
    os.sync()
    dist.barrier()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, dt)
    return max(times)


def _job(rank: int, world: int, sizes: dict, root: str, out: str, order: tuple[str, ...]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    side = dist.new_group(backend="gloo")  # async saves' collectives, apart from the timing's (as torchtitan does)
    g = torch.Generator().manual_seed(rank)

    def fresh(fill: bool) -> dict:
        model = {k: distribute_tensor(torch.empty(s), mesh, [Shard(0)], src_data_rank=None) for k, s in sizes.items()}
        if fill:
            for v in model.values():
                v.to_local().copy_(torch.randn(v.to_local().shape, generator=g))
        return {"model": model, "step": 7}

    state = fresh(True)
    times: dict[str, dict[str, float]] = {m: {} for m in METHODS}
    import shardckpt

    for method in order:
        path = os.path.join(root, method)
        pending = []
        if method == "native":
            times[method]["save"] = _timed(dist, lambda: shardckpt.save(state, path))
            shardckpt.async_save(state, path + "-warm").wait()  # its buffers and plan are reused from the 2nd on
            times[method]["async_blocked"] = _timed(dist, lambda: pending.append(shardckpt.async_save(
                state, path + "-async")))
            pending[0].wait()
        else:
            times[method]["save"] = _timed(dist, lambda: dcp.save(state, storage_writer=_storage(method, path, False)))
            times[method]["async_blocked"] = _timed(dist, lambda: pending.append(dcp.async_save(
                state, storage_writer=_storage(method, path + "-async", False), process_group=side)))
            pending[0].result()
        target = fresh(False)
        if rank == 0:
            drop_caches()
        times[method]["load"] = _timed(dist, lambda: dcp.load(target, storage_reader=_storage(method, path, True))
                                       if method != "native" else shardckpt.load(target, path))
        for k, v in state["model"].items():
            assert torch.equal(target["model"][k].to_local(), v.to_local()), (method, k)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            for suffix in ("-async", "-warm"):
                shutil.rmtree(path + suffix, ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.barrier()


def run_once(sizes: dict, base: str, order: tuple[str, ...]) -> dict:
    root = tempfile.mkdtemp(dir=base)
    out = os.path.join(root, "result.json")
    try:
        spawn_gloo(2, _job, sizes, root, out, order)
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.125, 1
    sizes = shapes(args.gib)
    total = sum(a * b * 4 for a, b in sizes.values())
    print(f"# {total / 2**30:.3f} GiB fp32 DTensors at ws 2; load average {loadavg()}", file=sys.stderr)
    base = os.environ.get("BENCH_DIR", tempfile.gettempdir())
    n = len(METHODS)
    runs = [run_once(sizes, base, METHODS[r % n:] + METHODS[:r % n]) for r in range(args.repeats)]
    med = {m: {s: median([r[m][s] for r in runs]) for s in STEPS} for m in METHODS}
    if args.json:
        print(json.dumps({"bytes": total, "median_s": med, "runs": runs}, indent=2))
    print(f"seconds, max over 2 ranks, medians of {args.repeats} (load average now {loadavg()})")
    print(f"  {'':10s} {'save':>8s} {'async blocked':>14s} {'load (cold)':>12s}")
    for m in METHODS:
        print(f"  {m:10s} {med[m]['save']:8.3f} {med[m]['async_blocked']:14.3f} {med[m]['load']:12.3f}")
    for step in STEPS:
        for peer in ("dcp1", "dcp2"):
            ratio = med["shardckpt"][step] / med[peer][step]
            print(f"  {verdict(ratio <= 1.0)}  {step}: shardckpt backend / {peer} = {ratio:.2f}x (target <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
