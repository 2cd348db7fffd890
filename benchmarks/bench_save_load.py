"""Save / cold-load throughput of shardckpt against the disk and its peers, side by side in one process.

Workload: a transformer-shaped fp32 state dict (embedding, per layer attention q/k/v/o and MLP up/down
plus two norms, a final norm and an lm_head), ``--gib`` GiB in all, built once.

Methods (interleaved within each repeat, the order rotating from repeat to repeat):

- ``raw``: the limit. Save: the tensors' bytes written sequentially to one file, then fsync.
  Load: the same file read sequentially (``readinto``) straight into the preallocated tensors.
- ``shardckpt``: ``shardckpt.save`` (fsyncs itself) / ``shardckpt.load`` into preallocated tensors,
  checksums verified (the default).
- ``dcp2`` / ``dcp1``: ``torch.distributed.checkpoint`` with ``FileSystemWriter(thread_count=2)`` and
  the default single thread (``sync_files=True``: it fsyncs itself) / ``dcp.load`` into preallocated tensors.
- ``torch``: ``torch.save`` to a file + flush + fsync / ``torch.load(mmap=True)`` (lazy: the touch pass
  faults the pages in).
- ``safetensors``: ``save_file`` + fsync / ``load_file`` (allocates its own tensors).

Before every save the previous output is removed and the page cache dropped; before every load the
page cache is dropped again (root only; otherwise a warning). Every timed load includes a touch pass
(``tensor.sum()`` over every loaded tensor) so that lazily mapped peers pay for their I/O; for shardckpt,
raw and DCP the bytes are already in the targets and the touch only reads memory (it is reported
separately as ``touch`` so it can be subtracted). Peak memory: RSS high-water mark (sampled every 5 ms)
during load + touch, above the RSS before it (targets already allocated and faulted in).

World size 2: two spawned gloo processes each hold the dim-0 half of every tensor
(``ShardedTensor.dim0_chunk``) and run the collective ``shardckpt.save``, vs the raw write of all bytes
from one process, and vs a raw write of each rank's half in parallel.

    python benchmarks/bench_save_load.py                 # 1 GiB, 3 repeats
    python benchmarks/bench_save_load.py --quick         # ~64 MiB, 1 repeat
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import (
    RssSampler,
    Timer,
    can_drop_caches,
    drop_caches,
    fsync_path,
    loadavg,
    median,
    remove,
    verdict,
)

import shardckpt

GIB = 1 << 30
SAVE_METHODS = ["raw", "shardckpt", "dcp2", "dcp1", "torch", "safetensors"]
LOAD_METHODS = ["raw", "shardckpt", "dcp", "torch", "safetensors"]


# ------------------------------------------------------------------------------------------- workload


def model_shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """Transformer-shaped fp32 parameters totalling about ``gib`` GiB."""
    target = gib * GIB / 4
    if gib >= 0.5:
        hidden, vocab = 2048, 32000
    elif gib >= 0.1:
        hidden, vocab = 1024, 16000
    else:
        hidden, vocab = 512, 8000
    ffn = 4 * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((target - fixed) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (hidden,)
        for w in ("q", "k", "v", "o"):
            shapes[p + f"attn.{w}.weight"] = (hidden, hidden)
        shapes[p + "mlp_norm.weight"] = (hidden,)
        shapes[p + "mlp.up.weight"] = (ffn, hidden)
        shapes[p + "mlp.down.weight"] = (hidden, ffn)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def nbytes_of(shapes: dict) -> int:
    total = 0
    for s in shapes.values():
        n = 4
        for d in s:
            n *= d
        total += n
    return total


def make_state_dict(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def make_targets(shapes: dict) -> dict[str, torch.Tensor]:
    """Preallocated, faulted-in (zero-filled) destination tensors."""
    return {k: torch.zeros(s) for k, s in shapes.items()}


def touch(tensors) -> float:
    """Read every byte of every tensor (a sum); returns the sum so the work cannot be skipped."""
    total = 0.0
    for t in tensors:
        total += float(t.sum())
    return total


# ------------------------------------------------------------------------------------------ methods


def _write_all(fd: int, mv: memoryview) -> None:
    done = 0
    while done < len(mv):
        done += os.write(fd, mv[done:])


def save_raw(sd: dict, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in sd.values():
            _write_all(fd, memoryview(t.numpy()).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)


def load_raw(targets: dict, path: str) -> list:
    with open(path, "rb", buffering=0) as f:
        for t in targets.values():
            mv = memoryview(t.numpy()).cast("B")
            done = 0
            while done < len(mv):
                n = f.readinto(mv[done:])
                if not n:
                    raise EOFError(path)
                done += n
    return targets


def save_shardckpt(sd: dict, path: str) -> None:
    shardckpt.save(sd, path)


def load_shardckpt(targets: dict, path: str) -> list:
    shardckpt.load(targets, path)
    return targets


def _dcp():
    import torch.distributed.checkpoint as dcp
    return dcp


def save_dcp(sd: dict, path: str, threads: int) -> None:
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))


def load_dcp(targets: dict, path: str) -> list:
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=dcp.FileSystemReader(path))
    return targets


def save_torch(sd: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def load_torch(targets: dict, path: str) -> list:
    return torch.load(path, mmap=True, weights_only=True)


def save_safetensors(sd: dict, path: str) -> None:
    from safetensors.torch import save_file
    save_file(sd, path)
    fsync_path(path)


def load_safetensors(targets: dict, path: str) -> list:
    from safetensors.torch import load_file
    return load_file(path)


SAVERS = {
    "raw": save_raw, "shardckpt": save_shardckpt, "dcp2": lambda sd, p: save_dcp(sd, p, 2),
    "dcp1": lambda sd, p: save_dcp(sd, p, 1), "torch": save_torch, "safetensors": save_safetensors,
}
LOADERS = {"raw": load_raw, "shardckpt": load_shardckpt, "dcp": load_dcp, "torch": load_torch,
           "safetensors": load_safetensors}
# which saved output each load reads
LOAD_SOURCE = {"raw": "raw", "shardckpt": "shardckpt", "dcp": "dcp2", "torch": "torch", "safetensors": "safetensors"}


def out_path(base: str, method: str) -> str:
    ext = {"raw": ".bin", "torch": ".pt", "safetensors": ".safetensors"}.get(method, "")
    return os.path.join(base, f"{method}{ext}")


# ------------------------------------------------------------------------------------- one process


def run_single(sd: dict, shapes: dict, base: str, repeats: int, check: bool) -> dict:
    res: dict = {"save": {m: [] for m in SAVE_METHODS}, "load": {m: [] for m in LOAD_METHODS},
                 "load_only": {m: [] for m in LOAD_METHODS}, "touch": {m: [] for m in LOAD_METHODS},
                 "peak_delta": {m: [] for m in LOAD_METHODS}, "loadavg": [],
                 "save_cpu": {m: [] for m in SAVE_METHODS}, "load_cpu": {m: [] for m in LOAD_METHODS}}
    targets = make_targets(shapes)
    touch(sd.values())  # warm up the reduction kernels / thread pool outside any timing
    for rep in range(repeats):
        res["loadavg"].append(loadavg())
        order = SAVE_METHODS[rep % len(SAVE_METHODS):] + SAVE_METHODS[:rep % len(SAVE_METHODS)]
        for m in order:
            p = out_path(base, m)
            remove(p)
            drop_caches()
            with Timer() as t:
                SAVERS[m](sd, p)
            res["save"][m].append(t.s)
            res["save_cpu"][m].append(t.cpu)
            print(f"  rep {rep} save {m:12s} {t.s:7.3f} s, CPU {t.cpu:.3f} s", flush=True)
        order = LOAD_METHODS[rep % len(LOAD_METHODS):] + LOAD_METHODS[:rep % len(LOAD_METHODS)]
        for m in order:
            for t in targets.values():
                t.zero_()
            gc.collect()
            drop_caches()
            with RssSampler() as mem:
                t0, c0 = time.perf_counter(), time.process_time()
                got = LOADERS[m](targets, out_path(base, LOAD_SOURCE[m]))
                t1 = time.perf_counter()
                touch(got.values())
                t2, c2 = time.perf_counter(), time.process_time()
            res["load_cpu"][m].append(c2 - c0)
            res["load"][m].append(t2 - t0)
            res["load_only"][m].append(t1 - t0)
            res["touch"][m].append(t2 - t1)
            res["peak_delta"][m].append(mem.delta)
            print(f"  rep {rep} load {m:12s} {t2 - t0:7.3f} s (load {t1 - t0:.3f} + touch {t2 - t1:.3f}), CPU {c2 - c0:.3f} s, "
                  f"peak RSS +{mem.delta / GIB:.3f} GiB", flush=True)
            if check and rep == 0:
                for k in shapes:
                    if not torch.equal(got[k], sd[k]):
                        raise AssertionError(f"{m}: {k} loaded wrong")
            del got
    return res


# ------------------------------------------------------------------------------------- world size 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ws2_worker(rank: int, world: int, shapes: dict, base: str, repeats: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from shardckpt import ShardedTensor

    g = torch.Generator().manual_seed(rank + 1)
    sd = {}
    for k, shape in shapes.items():
        rows = -(-shape[0] // world)
        lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        local = torch.randn((hi - lo,) + shape[1:], generator=g)
        sd[k] = ShardedTensor.dim0_chunk(local, shape, rank, world)
    times: dict = {"shardckpt": [], "raw_parallel": []}
    for rep in range(repeats):
        for m in (["shardckpt", "raw_parallel"] if rep % 2 == 0 else ["raw_parallel", "shardckpt"]):
            target = os.path.join(base, f"ws2-{m}")
            if rank == 0:
                remove(target)
                os.makedirs(target, exist_ok=True) if m == "raw_parallel" else None
                drop_caches()
            dist.barrier()
            t0 = time.perf_counter()
            if m == "shardckpt":
                shardckpt.save(sd, target)
            else:
                save_raw({k: v.local for k, v in sd.items()}, os.path.join(target, f"rank-{rank}.bin"))
            el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            times[m].append(float(el))
            if rank == 0:
                print(f"  rep {rep} ws2 {m:12s} {float(el):7.3f} s (max over ranks)", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
        for m in times:
            remove(os.path.join(base, f"ws2-{m}"))
    dist.barrier()
    dist.destroy_process_group()


def run_ws2(shapes: dict, base: str, repeats: int) -> dict:
    import torch.multiprocessing as mp

    out = os.path.join(base, "ws2.json")
    mp.spawn(_ws2_worker, args=(2, shapes, base, repeats, _free_port(), out), nprocs=2, join=True)
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------- report


def report(res: dict, ws2: dict | None, total: int, args) -> dict:
    S = {m: median(v) for m, v in res["save"].items()}
    L = {m: median(v) for m, v in res["load"].items()}
    Smin = {m: min(v) for m, v in res["save"].items()}
    Lmin = {m: min(v) for m, v in res["load"].items()}
    Lo = {m: median(v) for m, v in res["load_only"].items()}
    T = {m: median(v) for m, v in res["touch"].items()}
    P = {m: max(v) for m, v in res["peak_delta"].items()}
    gib = total / GIB
    print(f"\n== {gib:.3f} GiB fp32, {args.repeats} repeat(s), medians (and minimums); "
          f"loadavg at repeat starts: {res['loadavg']}")
    print(f"{'save':14s} {'median s':>8s} {'min s':>7s} {'GiB/s':>7s} {'x raw':>7s} {'min x raw':>9s}")
    for m in SAVE_METHODS:
        print(f"{m:14s} {S[m]:8.3f} {Smin[m]:7.3f} {gib / S[m]:7.2f} {S[m] / S['raw']:7.2f} {Smin[m] / Smin['raw']:9.2f}")
    print(f"\n{'load+touch':14s} {'median s':>8s} {'min s':>7s} {'load':>7s} {'touch':>7s} {'GiB/s':>7s} {'x raw':>7s} "
          f"{'min x raw':>9s} {'peakRSS+':>9s}")
    for m in LOAD_METHODS:
        print(f"{m:14s} {L[m]:8.3f} {Lmin[m]:7.3f} {Lo[m]:7.3f} {T[m]:7.3f} {gib / L[m]:7.2f} {L[m] / L['raw']:7.2f} "
              f"{Lmin[m] / Lmin['raw']:9.2f} {P[m] / total:8.1%}")

    def checks_for(S, L, W):
        out = [
            ("save <= 1.15x raw write", S["shardckpt"] / S["raw"], S["shardckpt"] <= 1.15 * S["raw"]),
            ("save faster than dcp 2 threads (dcp2/shardckpt > 1)", S["dcp2"] / S["shardckpt"],
             S["shardckpt"] < S["dcp2"]),
            ("save >= 1.8x faster than dcp 1 thread (dcp1/shardckpt)", S["dcp1"] / S["shardckpt"],
             S["dcp1"] >= 1.8 * S["shardckpt"]),
            ("cold load <= 1.3x raw read", L["shardckpt"] / L["raw"], L["shardckpt"] <= 1.3 * L["raw"]),
            ("cold load >= 2x faster than dcp.load (dcp/shardckpt)", L["dcp"] / L["shardckpt"],
             L["dcp"] >= 2 * L["shardckpt"]),
            ("cold load no slower than safetensors (st/shardckpt >= 1)", L["safetensors"] / L["shardckpt"],
             L["shardckpt"] <= L["safetensors"]),
            ("load peak RSS <= +10% of loaded bytes", P["shardckpt"] / total, P["shardckpt"] <= 0.10 * total),
        ]
        if W:
            out.append(("ws2 save <= 1.15x raw write of all bytes", W["shardckpt"] / S["raw"],
                        W["shardckpt"] <= 1.15 * S["raw"]))
        return out

    W = Wmin = None
    if ws2:
        W = {m: median(v) for m, v in ws2.items()}
        Wmin = {m: min(v) for m, v in ws2.items()}
        print(f"\nworld size 2 save (max over ranks), median (min): shardckpt {W['shardckpt']:.3f} "
              f"({Wmin['shardckpt']:.3f}) s, raw write per rank in parallel {W['raw_parallel']:.3f} "
              f"({Wmin['raw_parallel']:.3f}) s, raw single-process write of all bytes {S['raw']:.3f} ({Smin['raw']:.3f}) s")
    checks = checks_for(S, L, W)
    checks_min = checks_for(Smin, Lmin, Wmin)
    print("\ntargets (on medians; on minimums):")
    for (name, ratio, ok), (_, rmin, okmin) in zip(checks, checks_min):
        print(f"  {verdict(ok)}  {name}: {ratio:.2f}   [min: {rmin:.2f} {verdict(okmin)}]")
    return {"gib": gib, "bytes": total, "repeats": args.repeats, "save_median_s": S, "load_median_s": L,
            "save_min_s": Smin, "load_min_s": Lmin,
            "save_cpu_median_s": {m: median(v) for m, v in res["save_cpu"].items()},
            "load_cpu_median_s": {m: median(v) for m, v in res["load_cpu"].items()},
            "load_only_median_s": Lo, "touch_median_s": T, "peak_rss_delta_bytes_max": P, "raw": res,
            "ws2": ws2, "checks": [{"target": n, "ratio": r, "pass": ok} for n, r, ok in checks],
            "checks_min": [{"target": n, "ratio": r, "pass": ok} for n, r, ok in checks_min],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--quick", action="store_true", help="~64 MiB, 1 repeat (smoke run)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--skip-ws2", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exactness check of the first repeat")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.repeats = 1 / 16, 1
    if not can_drop_caches():
        print("WARNING: not root: caches cannot be dropped; loads will not be cold", file=sys.stderr)
    base = args.dir or tempfile.mkdtemp(prefix="shardckpt-bench-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    shapes = model_shapes(args.gib)
    total = nbytes_of(shapes)
    print(f"{len(shapes)} tensors, {total / GIB:.3f} GiB fp32, dir {base}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, loadavg {loadavg()}", flush=True)
    sd = make_state_dict(shapes)
    try:
        res = run_single(sd, shapes, base, args.repeats, not args.no_check)
        del sd
        gc.collect()
        ws2 = None if args.skip_ws2 else run_ws2(shapes, base, args.repeats)
        summary = report(res, ws2, total, args)
    finally:
        if args.dir is None:
            remove(base)
        else:
            for m in SAVE_METHODS:
                remove(out_path(base, m))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
