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
- ``adapter`` (issue 36): ``export`` as above through an adapter that permutes every q and k projection's rows
  (the rotary permutation of ``torchtitan-llama``; a family registered for this workload's names), through the
  same CLI entry point;
- ``torch``: what accelerate's merge-weights does: ``dcp_to_torch_save`` of the DCP checkpoint, ``torch.load``,
  ``.to(bfloat16)``, ``safetensors.torch.save_file`` + fsync.

Before every run: outputs removed, ``sync``, page cache dropped (root only), then an untimed
``python -c "import torch, shardckpt"``. Peak RSS: each command's own (``bench_convert.child``). The first export
is checked with ``verify_export(DST, against=SRC)`` (every value equal to the source cast to bf16).

Targets (issue 10): export >= 2x faster than torch's path, <= 1.3x the limit, peak RSS <= 600 MiB. Issue 36: the
adapter's peak RSS within export's own figure (367 MiB at 1 GiB, measured in the same run: ``export``).

    python benchmarks/bench_export.py --repeats 3 --json /tmp/bench/export.json   # 1 GiB (~3 min)
    python benchmarks/bench_export.py --quick                                      # ~0.25 GiB, 1 repeat
    python benchmarks/bench_export.py --methods export,adapter                     # the adapter's RSS only
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
METHODS = ("limit", "export", "adapter", "torch")
ADAPTER_RSS_LIMIT = 367 * MIB  # export's own peak RSS at 1 GiB (issue 10's run)
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
ADAPTER_SCRIPT = """
import sys
from shardckpt.cli.main import main
from shardckpt.offline.adapters import register
from shardckpt.offline.adapters.base import Adapter, RopePermute, Rule
rules = (Rule(r"layers\\.\\d+\\.attn\\.[qk]\\.weight", r"\\g<0>", RopePermute("n_heads")), Rule(r"(.+)", r"\\1"))
register("bench-permute", Adapter("bench-permute", rules), Adapter("bench-permute", rules))
sys.exit(main(["export", *sys.argv[1:], "--adapter", "bench-permute:n_heads=16"]))
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
    from shardckpt.offline.export_plan import plan_shards

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
    res.update(startup=[], read=[], save=[], export_rss=[], adapter_rss=[], torch_rss=[], torch_inner=[], loadavg=[])
    cli = shardckpt_cli()
    for rep in range(args.repeats):
        res["loadavg"].append(loadavg())
        methods = [m for m in METHODS if m in args.methods]
        for m in methods[rep % len(methods):] + methods[:rep % len(methods)]:
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
            elif m == "adapter":
                wall, rss, _, cpu = child([sys.executable, "-c", ADAPTER_SCRIPT, shard_dir, exported, "--dtype", "bfloat16",
                                           "--max-shard-size", str(max_shard), "--quiet"], log)
                res["adapter"].append(wall)
                res["adapter_rss"].append(rss)
                line = f"{wall:7.3f} s, CPU {cpu:.3f} s, peak RSS {rss / MIB:.0f} MiB"
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
    ran = [m for m in METHODS if res[m]]
    M, mins = {m: median(res[m]) for m in ran}, {m: min(res[m]) for m in ran}
    out: dict = {"bytes": total, "tensors": ntensors, "repeats": args.repeats, "median_s": M, "min_s": mins,
                 "pass": {}, "raw": res}
    print(f"\n== export {total / GIB:.3f} GiB fp32 ({ntensors} tensors), SHARDED ws {SAVE_WORLD} -> bf16 safetensors in "
          f"{SHARDS} shards, cold; {args.repeats} repeats; loadavg at repeat starts: {res['loadavg']}")
    print(f"{'method':8s} {'median s':>9s} {'min s':>8s}  peak RSS")
    if "limit" in M:
        print(f"{'limit':8s} {M['limit']:9.3f} {mins['limit']:8.3f}  (start-up {median(res['startup']):.3f} + cold "
              f"read {median(res['read']):.3f} + save_file {median(res['save']):.3f}, medians)")
    for m in ("export", "adapter", "torch"):
        if m in M:
            out[f"{m}_peak_rss"] = max(res[f"{m}_rss"])
            print(f"{m:8s} {M[m]:9.3f} {mins[m]:8.3f}  {out[f'{m}_peak_rss'] / MIB:.0f} MiB")
    if "torch" in M and "export" in M:
        out["torch_over_export"] = r = M["torch"] / M["export"]
        paired = median([t / e for t, e in zip(res["torch"], res["export"])])
        print(f"torch / export  = {r:.2f} on medians ({paired:.2f} paired)  [{verdict(r >= TORCH_RATIO)} >= {TORCH_RATIO}]")
        out["pass"]["torch"] = r >= TORCH_RATIO
    if "limit" in M and "export" in M:
        out["export_over_limit"] = r = M["export"] / M["limit"]
        paired = median([e / lim for e, lim in zip(res["export"], res["limit"])])
        print(f"export / limit  = {r:.2f} on medians ({paired:.2f} paired)  [{verdict(r <= LIMIT_RATIO)} <= {LIMIT_RATIO}]")
        out["pass"]["limit"] = r <= LIMIT_RATIO
    if "export" in M:
        rss = out["export_peak_rss"]
        print(f"export peak RSS = {rss / MIB:.0f} MiB  [{verdict(rss <= RSS_LIMIT)} <= {RSS_LIMIT // MIB} MiB]")
        out["pass"]["rss"] = rss <= RSS_LIMIT
    if "adapter" in M:  # within 367 MiB, or within export's own peak where this run measures more
        rss, limit = out["adapter_peak_rss"], max(ADAPTER_RSS_LIMIT, out.get("export_peak_rss", 0))
        print(f"adapter peak RSS = {rss / MIB:.0f} MiB  [{verdict(rss <= limit)} <= {limit / MIB:.0f} MiB: 367 or "
              f"export's own in this run]" + (f"; adapter / export time {M['adapter'] / M['export']:.2f}"
                                              if "export" in M else ""))
        out["pass"]["adapter_rss"] = rss <= limit
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="~0.25 GiB, 1 repeat")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--methods", default=",".join(METHODS), help=f"which to run, comma-separated (default: all: "
                                                                f"{','.join(METHODS)})")
    args = p.parse_args()
    args.methods = args.methods.split(",")
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
