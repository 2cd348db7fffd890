"""``shardckpt export`` to bf16 safetensors (issue 10): 1 GiB fp32 at ws 4 -> 5 shards, cold, against torch's path
and the limit.

Workload: transformer-shaped fp32 model weights (``--gib`` GiB, default 1), built by 4 spawned gloo ranks
(127.0.0.1), each holding the dim-0 chunk of every tensor, saved twice: as a SHARDED shardckpt checkpoint
(``ShardedTensor.dim0_chunk``) and as a torch DCP checkpoint of the same chunks as ``DTensor``s.

Methods, interleaved within each repeat (the order rotating), each a subprocess timed from spawn to exit:

- ``limit``: the start-up of the tool (``python -c "import torch, shardckpt"``), plus one cold read of the
  source's bytes (``cat`` of its files), plus ``save_file`` + fsync of the already-cast dict from memory
  (timed inside a process that built the dict untimed);
- ``export``: ``shardckpt export SRC DST --dtype bfloat16 --max-shard-size S --quiet`` with S giving 5 shards;
- ``torch``: what accelerate's merge-weights does: ``dcp_to_torch_save`` of the DCP checkpoint, ``torch.load``,
  ``.to(bfloat16)``, ``safetensors.torch.save_file`` + fsync.

Before every run: outputs removed, ``sync``, page cache dropped (root only), then an untimed
``python -c "import torch, shardckpt"``. Peak RSS: each command's own (``bench_convert.child``). The first export
is checked with ``verify_export(DST, against=SRC)`` (every value equal to the source cast to bf16).

Targets (issue 10): export >= 2x faster than torch's path, <= 1.3x the limit, peak RSS <= 600 MiB.

    python benchmarks/bench_export.py --repeats 3 --json /tmp/bench/export.json   # 1 GiB (~3 min)
    python benchmarks/bench_export.py --quick                                      # ~0.25 GiB, 1 repeat
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import can_drop_caches, loadavg, median, remove, verdict
from bench_convert import _free_port, _local_chunk, child, code_version, du, prepare, shardckpt_cli
from bench_save_load import model_shapes

GIB, MIB = 1 << 30, 1 << 20
SAVE_WORLD, SHARDS = 4, 5
TORCH_RATIO, LIMIT_RATIO, RSS_LIMIT = 2.0, 1.3, 600 * MIB
METHODS = ("limit", "export", "torch")
IMPORT = "import torch, shardckpt.offline.convert, shardckpt.offline.export"  # what the tool holds at start (import shardckpt is lazy)
SAVE_SCRIPT = """
import json, os, sys, time
import torch, shardckpt
from safetensors.torch import save_file
sd = {k: v.to(torch.bfloat16) for k, v in shardckpt.load_full(sys.argv[1])["model"].items()}
t0 = time.perf_counter()
save_file(sd, sys.argv[2], metadata={"format": "pt"})
fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd); os.close(fd)
print(json.dumps({"save_s": time.perf_counter() - t0}))
"""
TORCH_SCRIPT = """
import json, os, sys, time
t0 = time.perf_counter()
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t1 = time.perf_counter()
dcp_to_torch_save(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
sd = {k: v.to(torch.bfloat16) for k, v in torch.load(sys.argv[2], weights_only=True)["model"].items()}
save_file(sd, sys.argv[3], metadata={"format": "pt"})
fd = os.open(sys.argv[3], os.O_RDONLY); os.fsync(fd); os.close(fd)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "dcp_to_torch_save_s": t2 - t1, "cast_and_save_s": t3 - t2}))
"""


def _build_worker(rank: int, world: int, shapes: dict, shard_dir: str, dcp_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import shardckpt
    from shardckpt import ShardedTensor

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    chunks = {name: _local_chunk(shape, rank, world, k)[0] for k, (name, shape) in enumerate(shapes.items())}
    shardckpt.save({"model": {n: ShardedTensor.dim0_chunk(t, shapes[n], rank, world) for n, t in chunks.items()},
                    "step": 1000}, shard_dir)

    def dtensor(t, shape):
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    dcp.save({"model": {n: dtensor(t, shapes[n]) for n, t in chunks.items()}, "step": 1000}, checkpoint_id=dcp_dir)
    dist.barrier()
    dist.destroy_process_group()


def build(shapes: dict, shard_dir: str, dcp_dir: str) -> None:
    import torch.multiprocessing as mp

    for d in (shard_dir, dcp_dir):
        remove(d)
    mp.spawn(_build_worker, args=(SAVE_WORLD, shapes, shard_dir, dcp_dir, _free_port()), nprocs=SAVE_WORLD, join=True)


def shard_limit(sizes: list[int]) -> int:
    """The smallest --max-shard-size (bytes) that export plans into ``SHARDS`` files for these bf16 sizes."""
    from shardckpt.offline.export import plan_shards

    limit = -(-sum(sizes) // SHARDS)
    while len(plan_shards(sizes, limit)) > SHARDS:
        limit += max(1, limit // 1000)
    return limit


def data_files(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".bin"))


def run(args, shard_dir: str, dcp_dir: str, base: str, max_shard: int) -> dict:
    exported, pt_out, st_out, limit_out = (os.path.join(base, n) for n in
                                           ("exported", "torch-full.pt", "torch.safetensors", "limit.safetensors"))
    log = os.path.join(base, "child")
    outputs = [exported, pt_out, st_out, limit_out]
    res: dict = {m: [] for m in METHODS}
    res.update(startup=[], read=[], save=[], export_rss=[], torch_rss=[], torch_inner=[], loadavg=[])
    cli = shardckpt_cli()
    for rep in range(args.repeats):
        res["loadavg"].append(loadavg())
        for m in METHODS[rep % 3:] + METHODS[:rep % 3]:
            prepare(outputs, log)
            if m == "limit":
                start, _, _, _ = child([sys.executable, "-c", IMPORT], log)
                t0 = time.perf_counter()
                subprocess.run(["cat", *data_files(shard_dir)], stdout=subprocess.DEVNULL, check=True)
                read = time.perf_counter() - t0
                _, _, text, _ = child([sys.executable, "-c", SAVE_SCRIPT, shard_dir, limit_out], log)
                save = json.loads(text.strip().splitlines()[-1])["save_s"]
                res["startup"].append(start), res["read"].append(read), res["save"].append(save)
                res["limit"].append(start + read + save)
                line = f"{start + read + save:7.3f} s (start-up {start:.3f} + cold read {read:.3f} + save_file {save:.3f})"
            elif m == "export":
                wall, rss, _, cpu = child([cli, "export", shard_dir, exported, "--dtype", "bfloat16",
                                           "--max-shard-size", str(max_shard), "--quiet"], log)
                res["export"].append(wall)
                res["export_rss"].append(rss)
                line = f"{wall:7.3f} s, CPU {cpu:.3f} s, peak RSS {rss / MIB:.0f} MiB"
                if "check" not in res:
                    res["check"] = check(exported, shard_dir)
                    line += f"; {len(res['check']['files'])} files; verify --against: {res['check']['verdict']}"
            else:
                wall, rss, text, cpu = child([sys.executable, "-c", TORCH_SCRIPT, dcp_dir, pt_out, st_out], log)
                inner = json.loads(text.strip().splitlines()[-1])
                res["torch"].append(wall)
                res["torch_rss"].append(rss)
                res["torch_inner"].append(inner)
                line = (f"{wall:7.3f} s (dcp_to_torch_save {inner['dcp_to_torch_save_s']:.3f}, cast + save_file "
                        f"{inner['cast_and_save_s']:.3f}), CPU {cpu:.3f} s, peak RSS {rss / MIB:.0f} MiB")
            print(f"  rep {rep} {m:7s} {line}", flush=True)
    res["sizes"] = {"shardckpt_src": du(shard_dir), "dcp_src": du(dcp_dir)}
    for o in outputs:
        remove(o)
    return res


def check(exported: str, src: str) -> dict:
    from shardckpt.offline.verify_export import verify_export

    result = verify_export(exported, against=src)
    files = sorted(f for f in os.listdir(exported) if f.endswith(".safetensors"))
    out = {"ok": result.ok, "tensors": result.values.tensors, "files": files,
           "verdict": verdict(result.ok and len(files) == SHARDS)}
    if not result.ok or len(files) != SHARDS:
        raise AssertionError(f"the export is wrong: {out}, {result.problems[:3]}")
    return out


def report(res: dict, total: int, ntensors: int, args) -> dict:
    M = {m: median(res[m]) for m in METHODS}
    mins = {m: min(res[m]) for m in METHODS}
    rss, trss = max(res["export_rss"]), max(res["torch_rss"])
    r_torch, r_limit = M["torch"] / M["export"], M["export"] / M["limit"]
    paired_torch = median([t / e for t, e in zip(res["torch"], res["export"])])
    paired_limit = median([e / lim for e, lim in zip(res["export"], res["limit"])])
    print(f"\n== export {total / GIB:.3f} GiB fp32 ({ntensors} tensors), SHARDED ws {SAVE_WORLD} -> bf16 safetensors in "
          f"{SHARDS} shards, cold; {args.repeats} repeats; loadavg at repeat starts: {res['loadavg']}")
    print(f"{'method':8s} {'median s':>9s} {'min s':>8s}  peak RSS")
    print(f"{'limit':8s} {M['limit']:9.3f} {mins['limit']:8.3f}  (start-up {median(res['startup']):.3f} + cold read "
          f"{median(res['read']):.3f} + save_file {median(res['save']):.3f}, medians)")
    print(f"{'export':8s} {M['export']:9.3f} {mins['export']:8.3f}  {rss / MIB:.0f} MiB")
    print(f"{'torch':8s} {M['torch']:9.3f} {mins['torch']:8.3f}  {trss / MIB:.0f} MiB")
    print(f"torch / export  = {r_torch:.2f} on medians ({paired_torch:.2f} paired)  [{verdict(r_torch >= TORCH_RATIO)} "
          f">= {TORCH_RATIO}]")
    print(f"export / limit  = {r_limit:.2f} on medians ({paired_limit:.2f} paired)  [{verdict(r_limit <= LIMIT_RATIO)} "
          f"<= {LIMIT_RATIO}]")
    print(f"export peak RSS = {rss / MIB:.0f} MiB  [{verdict(rss <= RSS_LIMIT)} <= {RSS_LIMIT // MIB} MiB]; torch's "
          f"path {trss / MIB:.0f} MiB")
    return {"bytes": total, "tensors": ntensors, "repeats": args.repeats, "median_s": M, "min_s": mins,
            "torch_over_export": r_torch, "export_over_limit": r_limit, "export_peak_rss": rss, "torch_peak_rss": trss,
            "pass": {"torch": r_torch >= TORCH_RATIO, "limit": r_limit <= LIMIT_RATIO, "rss": rss <= RSS_LIMIT},
            "raw": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="~0.25 GiB, 1 repeat")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.25, 1
    if not can_drop_caches():
        print("WARNING: not root: the page cache cannot be dropped, nothing is cold", file=sys.stderr)
    base = args.dir or tempfile.mkdtemp(prefix="bench-export-")
    os.makedirs(base, exist_ok=True)
    shapes = model_shapes(args.gib)
    total = sum(4 * math.prod(s) for s in shapes.values())
    shard_dir, dcp_dir = os.path.join(base, "src-shardckpt"), os.path.join(base, "src-dcp")
    print(f"{code_version()}; building {total / GIB:.3f} GiB ({len(shapes)} tensors) at ws {SAVE_WORLD} ...", flush=True)
    build(shapes, shard_dir, dcp_dir)
    max_shard = shard_limit([2 * math.prod(s) for s in shapes.values()])
    result = report(run(args, shard_dir, dcp_dir, base, max_shard), total, len(shapes), args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.dir:
        remove(base)


if __name__ == "__main__":
    main()
