"""Incremental saves (issue 39) side by side at world size 2 (gloo): bytes written per save, save wall time, the
blocked time of ``async_save``, and the load time of a pooled step against a standalone one.

Workloads (each rank holds the dim-0 half of every tensor, ``ShardedTensor``; DCP gets the same as DTensors):

- ``lora``: a frozen fp32 base of ``--gib`` GiB (16 square matrices) plus 2 % trainable parameters (rank-r adapters
  per matrix) with AdamW moments; between saves the adapters and moments change (an optimizer step), the base not;
- ``emb``: an fp32 embedding table of ``--emb-gib`` GiB (2 KiB rows) plus a small dense layer; between saves 5 % of
  the rows change, ``uniform`` (random rows) or ``clustered`` (one contiguous range), saved with 4 MiB units and, for
  uniform, 64 KiB units too.

Methods, each saving ``--saves`` times in a row after one untimed save that makes the first pool generation:
``full`` (``shardckpt.save``), ``incremental`` (``save(incremental=True)``), ``async full`` / ``async incr``
(``async_save``: blocked time, then the wait), ``dcp`` (``torch.distributed.checkpoint.save``) and, for lora,
``dcp frozen-out`` (DCP of the state without the frozen base: what ``ignore_frozen_params`` leaves, a checkpoint
that no longer stands alone). Bytes: the files each save added on disk (for incremental: its pool generation and
manifest). Times: max over ranks, median over the timed saves. The page cache is not dropped.

    python benchmarks/bench_incremental.py                 # 1 GiB base, 0.5 GiB embeddings (~5 min on 2 cores)
    python benchmarks/bench_incremental.py --quick         # 128 MiB / 64 MiB
    python benchmarks/bench_incremental.py --long-run 300  # only: a long run's save time as its steps pile up

``--long-run N``: one process, N incremental saves into one run directory (every step kept) of a small state (200
tensors of 16 KiB and one of 1 MiB; one tensor changes per step): the save time should not grow with the steps kept.
Reported: the median save time over each block of 50 saves, and the mean over the last block (which counts the
saves that sweep the pool).
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
from _common import loadavg, median, spawn_gloo

DIM = 4096


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def lora_state(rank: int, world: int, gib: float) -> tuple[dict, dict, callable]:
    """This rank's halves: frozen base, adapters (2 % of the base) and AdamW-shaped moments; ``step()`` changes the
    trainable part in place."""
    n = max(1, int(gib * (1 << 30) / (DIM * DIM * 4)))
    rows = DIM // world
    g = torch.Generator().manual_seed(rank)
    r = max(1, int(0.02 * DIM * DIM / (2 * DIM)))  # rank r adapters: 2 * DIM * r = 2 % of DIM^2
    base = {f"l{i}.w": torch.randn(rows, DIM, generator=g) for i in range(n)}
    train = {f"l{i}.{ab}": torch.randn(rows, r, generator=g) * 0.01 for i in range(n) for ab in ("a", "b")}
    moments = {f"{k}.{m}": torch.zeros_like(v) for k, v in train.items() for m in ("exp_avg", "exp_avg_sq")}
    shapes = {**{k: (DIM, DIM) for k in base}, **{k: (DIM, r) for k in train}, **{k: (DIM, r) for k in moments}}

    def step() -> None:
        for v in list(train.values()) + list(moments.values()):
            v.add_(1e-3)

    tensors = {"model": {**base, **train}, "optim": moments}
    return tensors, shapes, step


def emb_state(rank: int, world: int, gib: float, clustered: bool) -> tuple[dict, dict, callable]:
    rows_total = int(gib * (1 << 30) / (512 * 4))
    rows = rows_total // world
    g = torch.Generator().manual_seed(rank)
    emb = torch.randn(rows, 512, generator=g)
    dense = torch.randn(1024 // world, 1024, generator=g)
    shapes = {"emb": (rows_total, 512), "dense": (1024, 1024)}
    calls = [0]

    def step() -> None:
        calls[0] += 1
        k = max(1, int(0.05 * rows))
        if clustered:
            start = (calls[0] * 7919) % (rows - k)
            emb[start:start + k].add_(1e-3)
        else:
            idx = torch.randperm(rows, generator=torch.Generator().manual_seed(calls[0]))[:k]
            emb[idx] += 1e-3
        dense.add_(1e-3)

    return {"model": {"emb": emb, "dense": dense}}, shapes, step


def _sharded(tensors: dict, shapes: dict, rank: int) -> dict:
    from shardckpt import Box, ShardedTensor

    def wrap(name, v):
        full = shapes[name.split(".", 1)[1] if name not in shapes else name]
        return ShardedTensor(v, full, Box((rank * v.shape[0], 0), tuple(v.shape)))

    return {group: {k: wrap(k if k in shapes else f"{group}.{k}", v) for k, v in part.items()}
            for group, part in tensors.items()}


def _dtensors(tensors: dict, shapes: dict, world: int, skip_frozen: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for group, part in tensors.items():
        out[group] = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False, shape=torch.Size(shapes[k]),
                                            stride=(shapes[k][1], 1))
                      for k, v in part.items() if not (skip_frozen and k.endswith(".w"))}
    return out


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, dt)
    return max(times)


def _summed(value: int) -> int:
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return sum(values)


def _method(method: str, sd: dict, dt: dict, path: str, unit: int) -> dict:
    """One save by ``method``: its wall time, and for async ones the blocked time."""
    import torch.distributed.checkpoint as dcp

    import shardckpt
    from shardckpt.checkpoint.async_save import saver_for

    out = {}
    if method in ("full", "incremental"):
        out["save_s"] = _timed(lambda: shardckpt.save(sd, path, incremental=method == "incremental",
                                                      incremental_unit=unit))
    elif method.startswith("async"):
        handle = []
        out["blocked_s"] = _timed(lambda: handle.append(shardckpt.async_save(
            sd, path, incremental=method == "async incr", incremental_unit=unit)))
        out["save_s"] = out["blocked_s"] + _timed(lambda: handle[0].wait())
        out["staging_bytes"] = _summed(saver_for(None).staging_bytes)
    else:
        out["save_s"] = _timed(lambda: dcp.save(dt, checkpoint_id=path))
    return out


def _job(rank: int, world: int, workload: str, gib: float, unit: int, saves: int, root: str, out: str,
         methods: tuple) -> None:
    import torch.distributed as dist

    import shardckpt

    if workload == "lora":
        tensors, shapes, step = lora_state(rank, world, gib)
    else:
        tensors, shapes, step = emb_state(rank, world, gib, workload == "emb clustered")
    flat_shapes = {**shapes, **{f"{g}.{k}": shapes[k] for g, p in tensors.items() for k in p}}
    sd = _sharded(tensors, flat_shapes, rank)
    results = {}
    for method in methods:
        dt = _dtensors(tensors, shapes, world, method == "dcp frozen-out") if method.startswith("dcp") else None
        run = os.path.join(root, method.replace(" ", "_"))
        _method(method, sd, dt, os.path.join(run, "step-0"), unit)  # untimed: the pool's first generation
        rows = []
        for i in range(1, saves + 1):
            step()
            path = os.path.join(run, f"step-{i}")
            before = du(run) if rank == 0 else 0
            row = _method(method, sd, dt, path, unit)
            dist.barrier()
            row["bytes"] = du(run) - before if rank == 0 else 0
            rows.append(row)
        if method in ("full", "incremental"):
            target = {g: {k: torch.empty_like(v) for k, v in p.items()} for g, p in tensors.items()}
            target_sd = _sharded(target, flat_shapes, rank)
            rows[-1]["load_s"] = _timed(lambda: shardckpt.load(target_sd, os.path.join(run, f"step-{saves}")))
        results[method] = rows
        dist.barrier()
        if rank == 0:
            shutil.rmtree(run, ignore_errors=True)
    if rank == 0:
        changed = sum(v.nbytes for g, p in tensors.items() for k, v in p.items() if not k.endswith(".w")) * world
        with open(out, "w") as f:
            json.dump({"results": results, "total_bytes": sum(v.nbytes for p in tensors.values()
                                                              for v in p.values()) * world,
                       "lora_changed_bytes": changed}, f)


def run(workload: str, gib: float, unit: int, saves: int, methods: tuple) -> dict:
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    out = os.path.join(root, "result.json")
    try:
        spawn_gloo(2, _job, workload, gib, unit, saves, root, out, methods)
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(name: str, found: dict) -> dict:
    rows = {}
    for method, saves in found["results"].items():
        rows[method] = {k: median([s[k] for s in saves if k in s])
                        for k in ("save_s", "blocked_s", "staging_bytes", "bytes", "load_s") if any(k in s for s in saves)}
    print(f"\n{name}: {found['total_bytes'] / 2**20:.0f} MiB of state")
    print(f"  {'method':16s} {'bytes/save':>12s} {'save s':>8s} {'blocked s':>10s} {'staged':>10s} {'load s':>8s}")
    for method, r in rows.items():
        print(f"  {method:16s} {r['bytes'] / 2**20:10.1f}Mi {r['save_s']:8.3f} "
              f"{r.get('blocked_s', float('nan')):10.3f} {r.get('staging_bytes', float('nan')) / 2**20:8.1f}Mi "
              f"{r.get('load_s', float('nan')):8.3f}")
    return rows


def long_run(saves: int) -> dict:
    import shardckpt

    sd = {f"layer{i}.w": torch.randn(64, 64) for i in range(200)}
    sd["big"] = torch.randn(1 << 18)
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    times = []
    try:
        for i in range(saves):
            sd["layer0.w"].add_(1)
            t = time.perf_counter()
            shardckpt.save(sd, os.path.join(root, f"step-{i}"), incremental=True)
            times.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    blocks = {f"{k + 1}-{min(k + 50, saves)}": median(times[k:k + 50]) for k in range(0, saves, 50)}
    last = times[-min(50, saves):]
    print(f"\nlong run, {saves} incremental saves, every step kept: median save time per block of steps")
    for block, t in blocks.items():
        print(f"  steps {block:>10s}: {t * 1000:7.1f} ms")
    print(f"  mean of the last {len(last)} (with the saves that sweep): {sum(last) / len(last) * 1000:.1f} ms")
    return {"median_s_by_steps": blocks, "mean_last_s": sum(last) / len(last)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--emb-gib", type=float, default=0.5)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--long-run", type=int, metavar="N", help="only: N saves of a small state into one run")
    args = ap.parse_args()
    if args.long_run:
        found = long_run(args.long_run)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"long_run": found}, f, indent=2)
        return 0
    if args.quick:
        args.gib, args.emb_gib, args.saves = 0.125, 0.0625, 2
    print(f"# load average {loadavg()}", file=sys.stderr)
    all_methods = ("full", "incremental", "async full", "async incr", "dcp")
    out = {}
    lora = run("lora", args.gib, 4 << 20, args.saves, all_methods + ("dcp frozen-out",))
    out["lora"] = summary("lora (frozen base + 2 % trainable, AdamW)", lora)
    changed = lora["lora_changed_bytes"]
    inc, full = out["lora"]["incremental"], out["lora"]["full"]
    print(f"  changed bytes per save {changed / 2**20:.1f} MiB: incremental wrote {inc['bytes'] / changed:.3f}x of "
          f"them (target <= 1.1x + manifest); save time {inc['save_s'] / full['save_s']:.2f}x of a full save "
          f"(target 0.15x); load {inc['load_s'] / full['load_s']:.2f}x of a standalone step's (target 1.1x)")
    for name, workload, unit in (("emb uniform, 4 MiB units", "emb uniform", 4 << 20),
                                 ("emb uniform, 64 KiB units", "emb uniform", 64 << 10),
                                 ("emb clustered, 4 MiB units", "emb clustered", 4 << 20)):
        out[name] = summary(name, run(workload, args.emb_gib, unit, args.saves, ("full", "incremental", "dcp")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
