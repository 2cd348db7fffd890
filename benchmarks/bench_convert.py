"""Offline resharding with ``shardckpt convert`` (issue 9): ws 4 -> 3, cold, against the disk and torch's path.

Workload: a transformer-shaped fp32 model with Adam state (parameters + ``exp_avg`` + ``exp_avg_sq``,
``--gib`` GiB in all, default 2; ``step`` a plain int per parameter, one param group), built once by 4
spawned gloo ranks (127.0.0.1), each holding the dim-0 chunk of every tensor, and saved by them twice:

- with ``shardckpt.save`` of ``ShardedTensor.dim0_chunk`` (a SHARDED shardckpt checkpoint at ws 4);
- with ``torch.distributed.checkpoint.save`` of the same chunks as ``DTensor``s (``Shard(0)`` on a ws-4 CPU mesh).

Methods, interleaved within each repeat (the order rotating from repeat to repeat), each timed from the
parent as a subprocess, wall clock from spawn to exit:

- ``limit``: ``cp -r SRC X && sync`` (the same bytes copied and made durable) plus the start-up cost of
  the tool, measured in the same repeat as ``python -c "import torch, shardckpt"``;
- ``convert``: ``.venv/bin/shardckpt convert SRC DST --world-size 3 --quiet`` (fsyncs and commits itself);
- ``torch``: ``dcp_to_torch_save(DCP_DIR, out.pt)`` in ``python -c`` (then an fsync of ``out.pt``, so that
  it is as durable as the other two; its own timings of the call and the fsync are reported too).

Before every timed run: outputs removed, ``sync``, page cache dropped (root only; otherwise a warning and
nothing is cold), then one untimed ``python -c "import torch, shardckpt"`` so that the tools' code is
cached again as for any command run twice: the checkpoint's bytes are cold, Python and torch are not.
Peak RSS of ``convert`` and ``torch``: each one's own ``ru_maxrss``, through a small launcher (``child``); until
2026-11-23 it was read straight from this process's ``os.wait4``, which reports this process's peak when larger.
The first converted checkpoint is checked ``diff``-equal to the source (``shardckpt.offline.diff.diff``),
and the shardckpt and DCP sources are checked ``diff``-equal to each other (same state, by value).

Targets (issue 9): convert <= 1.5x the limit; torch's path >= 2.5x convert's time; convert's peak RSS
<= 600 MiB. Reported: medians and minimums, ratios on medians and the median of per-repeat ratios.

``--plan-70b``: only the planning ``convert`` does before writing, for a Llama-2-70B + AdamW SHARDED
checkpoint saved by 1024 ranks converted to 768 (the model and manifest of ``bench_manifest_scale.py``):
the manifest is built in memory and written alone to a scratch directory (no data files), then timed:
``open_reader``, then ``convert_plan.plan_conversion`` (the logical view, the selection, and one entry per
tensor: dim-0 chunks by arithmetic, replicas placed); peak RSS sampled. Target: <= 10 s and <= 2 GiB.
``--plan-405b``: the same for a Llama-3.1-405B-shaped model + AdamW (126 layers, hidden 16384, MLP 53248, vocab
128256: 3411 tensors), 1024 -> 8192 ranks (``--src-ranks`` / ``--dst-ranks`` change either).

    python benchmarks/bench_convert.py --repeats 3 --json /tmp/bench/convert.json   # 2 GiB (~3 min)
    python benchmarks/bench_convert.py --quick                                       # ~0.25 GiB, 1 repeat
    python benchmarks/bench_convert.py --plan-70b [--profile]                        # planning only
    python benchmarks/bench_convert.py --plan-405b                                   # planning, 405B at 8192 ranks
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import RssSampler, can_drop_caches, drop_caches, loadavg, median, remove, verdict

GIB = 1 << 30
MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_WORLD, OUT_WORLD = 4, 3
LIMIT_RATIO, TORCH_RATIO, RSS_LIMIT = 1.5, 2.5, 600 * MIB
PLAN_LIMIT_S, PLAN_RSS = 10.0, 2 * GIB
METHODS = ("limit", "convert", "torch")
IMPORT = "import torch, shardckpt.offline.convert, shardckpt.offline.export"  # what the tool holds at start (import shardckpt is lazy)
TORCH_SCRIPT = """
import json, os, sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t1 = time.perf_counter()
dcp_to_torch_save(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)
os.close(fd)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "call_s": t2 - t1, "fsync_s": t3 - t2}))
"""


# ------------------------------------------------------------------------------------------- workload


def param_shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """Transformer-shaped parameters of about ``gib / 3`` GiB (Adam adds two states of the same size)."""
    from bench_save_load import model_shapes

    return model_shapes(gib / 3)


def tensor_bytes(shapes: dict) -> int:
    return sum(4 * math.prod(s) for s in shapes.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_chunk(shape: tuple, rank: int, world: int, seed: int) -> tuple[torch.Tensor, int]:
    """This rank's dim-0 chunk (torch.chunk semantics) of tensor ``seed``, random values."""
    rows = -(-shape[0] // world)
    first, last = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
    g = torch.Generator().manual_seed(seed * 64 + rank)
    return torch.randn((last - first,) + tuple(shape[1:]), generator=g), first


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

    def trees(wrap):
        model, state = {}, {}
        for k, (name, shape) in enumerate(shapes.items()):
            vals = [_local_chunk(shape, rank, world, 3 * k + j) for j in range(3)]
            vals[2][0].abs_()  # exp_avg_sq >= 0
            model[name] = wrap(vals[0][0], shape)
            state[name] = {"step": 1000, "exp_avg": wrap(vals[1][0], shape), "exp_avg_sq": wrap(vals[2][0], shape)}
        groups = [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": list(shapes)}]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    sd = trees(lambda t, shape: ShardedTensor.dim0_chunk(t, shape, rank, world))
    shardckpt.save(sd, shard_dir)
    del sd
    gc.collect()

    def dtensor(t, shape):
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    dcp.save(trees(dtensor), checkpoint_id=dcp_dir)
    dist.barrier()
    dist.destroy_process_group()


def build(shapes: dict, shard_dir: str, dcp_dir: str) -> float:
    import torch.multiprocessing as mp

    for d in (shard_dir, dcp_dir):
        remove(d)
    t0 = time.perf_counter()
    mp.spawn(_build_worker, args=(SAVE_WORLD, shapes, shard_dir, dcp_dir, _free_port()), nprocs=SAVE_WORLD,
             join=True)
    return time.perf_counter() - t0


def code_version() -> str:
    """HEAD and the files under src/ that differ from it (the CLI runs the working tree)."""
    def git(*a):
        return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--short", "--", "src", "cli").split("\n")
    dirty = [d for d in dirty if d]
    return f"HEAD {git('rev-parse', '--short', 'HEAD')}" + (f", working tree differs in {len(dirty)} files: "
                                                           f"{' '.join(d.split()[-1] for d in dirty)}" if dirty else "")


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------------------ the runs


def child(cmd: list[str], log: str) -> tuple[float, int, str, float]:
    """Run ``cmd``; (wall seconds from spawn to exit, its own peak RSS in bytes, its stdout, its user+sys CPU
    seconds). Raises on failure. The RSS is measured through a small launcher (``run_measured``): measured
    from here, a child reports this process's peak RSS when that is larger."""
    from shardckpt.demo.processes import run_measured

    with open(log + ".out", "w+") as out, open(log + ".err", "w+") as err:
        t0 = time.perf_counter()
        returncode, rss, cpu = run_measured(cmd, out, err)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {returncode}:\n{errors[-4000:]}")
    return wall, rss, text, cpu


def shardckpt_cli() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "shardckpt")
    return here if os.path.exists(here) else os.path.join(REPO, ".venv", "bin", "shardckpt")


def prepare(outputs: list[str], log: str) -> None:
    """Outputs removed, page cache dropped, the tools' code read back in (untimed)."""
    for o in outputs:
        remove(o)
    drop_caches()
    child([sys.executable, "-c", IMPORT], log)


def run(args, shard_dir: str, dcp_dir: str, base: str) -> dict:
    cp_dst, conv_dst, pt_out = (os.path.join(base, n) for n in ("cp-copy", "converted", "torch-full.pt"))
    log = os.path.join(base, "child")
    outputs = [cp_dst, conv_dst, pt_out]
    res: dict = {m: [] for m in METHODS}
    res.update(startup=[], cp_sync=[], convert_rss=[], torch_rss=[], convert_cpu=[], torch_cpu=[], torch_inner=[],
               loadavg=[])
    cli = shardckpt_cli()
    checked = False
    for rep in range(args.repeats):
        res["loadavg"].append(loadavg())
        order = METHODS[rep % 3:] + METHODS[:rep % 3]
        for m in order:
            prepare(outputs, log)
            if m == "limit":
                start, _, _, _ = child([sys.executable, "-c", IMPORT], log)
                t0 = time.perf_counter()
                subprocess.run(f"cp -r '{shard_dir}' '{cp_dst}' && sync", shell=True, check=True)
                copy = time.perf_counter() - t0
                res["startup"].append(start)
                res["cp_sync"].append(copy)
                res["limit"].append(start + copy)
                line = f"{start + copy:7.3f} s (start-up {start:.3f} + cp -r & sync {copy:.3f})"
            elif m == "convert":
                wall, rss, _, cpu = child([cli, "convert", shard_dir, conv_dst, "--world-size", str(OUT_WORLD),
                                           "--quiet"], log)
                res["convert"].append(wall)
                res["convert_rss"].append(rss)
                res["convert_cpu"].append(cpu)
                line = f"{wall:7.3f} s, CPU {cpu:.3f} s, peak RSS {rss / MIB:.0f} MiB"
                if not checked and not args.no_check:
                    checked = True
                    res["check"] = check_converted(shard_dir, conv_dst)
                    line += f"; diff(SRC, DST): {res['check']['verdict']}"
            else:
                wall, rss, text, cpu = child([sys.executable, "-c", TORCH_SCRIPT, dcp_dir, pt_out], log)
                res["torch_cpu"].append(cpu)
                inner = json.loads(text.strip().splitlines()[-1])
                res["torch"].append(wall)
                res["torch_rss"].append(rss)
                res["torch_inner"].append(inner)
                line = (f"{wall:7.3f} s (dcp_to_torch_save {inner['call_s']:.3f}, fsync {inner['fsync_s']:.3f}), "
                        f"CPU {cpu:.3f} s, peak RSS {rss / MIB:.0f} MiB")
            print(f"  rep {rep} {m:8s} {line}", flush=True)
    res["sizes"] = {"shardckpt_src": du(shard_dir), "dcp_src": du(dcp_dir), "converted": du(conv_dst),
                    "torch_pt": du(pt_out) if os.path.exists(pt_out) else None}
    for o in outputs:
        remove(o)
    return res


def check_converted(src: str, dst: str) -> dict:
    from shardckpt.offline.diff import diff
    from shardckpt.formats.detect import open_reader

    t0 = time.perf_counter()
    rep = diff(src, dst)
    world = open_reader(dst).manifest.world_size
    ok = rep.equal and world == OUT_WORLD
    out = {"equal": rep.equal, "tensors": rep.tensors, "by_checksum": rep.by_checksum, "bytes_read": rep.bytes_read,
           "world_size": world, "seconds": time.perf_counter() - t0, "verdict": verdict(ok),
           "differences": [str(d) for d in rep.differences[:5]]}
    if not ok:
        raise AssertionError(f"converted checkpoint differs from the source: {out}")
    return out


def check_sources(shard_dir: str, dcp_dir: str) -> dict:
    from shardckpt.offline.diff import diff

    t0 = time.perf_counter()
    rep = diff(shard_dir, dcp_dir)
    out = {"equal": rep.equal, "tensors": rep.tensors, "bytes_read": rep.bytes_read,
           "seconds": time.perf_counter() - t0,
           "differences": [str(d) for d in rep.differences[:5]]}
    if not rep.equal:
        raise AssertionError(f"the shardckpt and DCP sources differ: {out}")
    return out


# --------------------------------------------------------------------------------------------- report


def report(res: dict, total: int, ntensors: int, args) -> dict:
    M = {m: median(res[m]) for m in METHODS}
    mins = {m: min(res[m]) for m in METHODS}
    paired_limit = median([c / lim for c, lim in zip(res["convert"], res["limit"])])
    paired_torch = median([t / c for t, c in zip(res["torch"], res["convert"])])
    rss, trss = max(res["convert_rss"]), max(res["torch_rss"])
    r_limit, r_torch = M["convert"] / M["limit"], M["torch"] / M["convert"]
    print(f"\n== convert {total / GIB:.3f} GiB fp32 model + Adam ({ntensors} tensors), SHARDED ws {SAVE_WORLD} -> "
          f"{OUT_WORLD}, cold; {args.repeats} repeats; loadavg at repeat starts: {res['loadavg']}")
    print(f"{'method':10s} {'median s':>9s} {'min s':>8s}  peak RSS")
    print(f"{'limit':10s} {M['limit']:9.3f} {mins['limit']:8.3f}  (start-up median {median(res['startup']):.3f} s "
          f"+ cp -r & sync median {median(res['cp_sync']):.3f} s)")
    print(f"{'convert':10s} {M['convert']:9.3f} {mins['convert']:8.3f}  {rss / MIB:.0f} MiB (max over repeats); CPU "
          f"median {median(res['convert_cpu']):.3f} s")
    tin = res["torch_inner"]
    print(f"{'torch':10s} {M['torch']:9.3f} {mins['torch']:8.3f}  {trss / MIB:.0f} MiB (dcp_to_torch_save call "
          f"median {median([x['call_s'] for x in tin]):.3f} s, fsync {median([x['fsync_s'] for x in tin]):.3f} s); CPU "
          f"median {median(res['torch_cpu']):.3f} s")
    if "check" in res:
        c = res["check"]
        print(f"check: diff(SRC, DST) equal={c['equal']} ({c['tensors']} tensors, {c['by_checksum']} by checksum), "
              f"DST world size {c['world_size']}: {c['verdict']}")
    print(f"convert / limit  = {r_limit:.2f} on medians ({mins['convert'] / mins['limit']:.2f} on minimums, "
          f"{paired_limit:.2f} paired)  [{verdict(r_limit <= LIMIT_RATIO)} <= {LIMIT_RATIO}]")
    print(f"torch / convert  = {r_torch:.2f} on medians ({mins['torch'] / mins['convert']:.2f} on minimums, "
          f"{paired_torch:.2f} paired)  [{verdict(r_torch >= TORCH_RATIO)} >= {TORCH_RATIO}]")
    print(f"convert peak RSS = {rss / MIB:.0f} MiB  [{verdict(rss <= RSS_LIMIT)} <= {RSS_LIMIT // MIB} MiB]; "
          f"torch's path {trss / MIB:.0f} MiB")
    return {"bytes": total, "tensors": ntensors, "repeats": args.repeats, "median_s": M, "min_s": mins,
            "convert_over_limit": r_limit, "convert_over_limit_paired": paired_limit,
            "torch_over_convert": r_torch, "torch_over_convert_paired": paired_torch,
            "convert_peak_rss": rss, "torch_peak_rss": trss,
            "pass": {"limit": r_limit <= LIMIT_RATIO, "torch": r_torch >= TORCH_RATIO, "rss": rss <= RSS_LIMIT},
            "raw": res}


# ------------------------------------------------------------------------------------- 70B planning


LLAMA_405B = dict(layers=126, hidden=16384, inter=53248, vocab=128256, kv_heads=8, head_dim=128)  # Llama-3.1-405B


def plan_70b(args) -> dict:
    import cProfile
    import io
    import pstats

    import bench_manifest_scale as ms

    from shardckpt.offline.convert_plan import plan_conversion
    from shardckpt.offline.spec import ConvertSpec
    from shardckpt.format.manifest import MANIFEST_NAME
    from shardckpt.format.tree import encode
    from shardckpt.formats.detect import open_reader

    params = ms.llama70b_params(**(LLAMA_405B if args.plan_405b else {}))
    tree = ms.state_tree(params, args.step_tensors)
    shapes = ms.tensor_shapes(tree)
    regions = ms.save_regions(shapes, args.src_ranks)
    manifest, _ = ms.build_manifest(shapes, regions, args.src_ranks)
    data = manifest.to_bytes(encode(tree, lambda v: isinstance(v, ms._Leaf)))
    del regions, manifest, tree
    scratch = tempfile.mkdtemp(prefix="shardckpt-plan70b-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with open(os.path.join(scratch, MANIFEST_NAME), "wb") as f:
        f.write(data)
    numel = sum(math.prod(s) for s in shapes.values())
    print(f"{'Llama-3.1-405B' if args.plan_405b else 'Llama-2-70B'} + AdamW: {len(params)} params, {len(shapes)} tensors ({numel * 4 / GIB:.0f} GiB fp32), "
          f"SHARDED at {args.src_ranks} ranks (manifest {len(data):,} B, no data files) -> {args.dst_ranks} ranks; "
          f"loadavg {loadavg()}; code: {code_version()}", flush=True)
    del data
    world = args.dst_ranks

    def planning(world: int) -> tuple[dict, object]:
        t = {}
        t0, c0 = time.perf_counter(), time.process_time()
        reader = open_reader(scratch)
        t1 = time.perf_counter()
        plan = plan_conversion(reader, ConvertSpec(scratch, os.path.join(scratch, "out"), world_size=world))
        chunks, outputs = plan.chunks, plan.what.outputs
        sum(chunks.tasks.bytes(r) for r in chunks.tasks.writing_ranks())  # convert's share and progress total
        t4 = time.perf_counter()
        t.update(open_select_s=t1 - t0, plan_s=t4 - t1,
                 total_s=t4 - t0, cpu_s=time.process_time() - c0, outputs=len(outputs),
                 tasks=sum(len(p.writers) for p in chunks.tensors.values()))
        return t, plan

    try:
        gc.collect()
        with RssSampler(0.01) as rss:
            t, plan = planning(world)
        del plan
        gc.collect()
        t.update(rss_before=rss.base, rss_peak=rss.peak, rss_delta=rss.delta)
        print(f"planning {t['outputs']} tensors x {world} ranks ({t['tasks']:,} write tasks): {t['total_s']:.2f} s "
              f"wall, {t['cpu_s']:.2f} s CPU [{verdict(t['total_s'] <= PLAN_LIMIT_S)} <= {PLAN_LIMIT_S:.0f} s]\n"
              f"  open_reader {t['open_select_s']:.2f} s, plan_conversion (logical view, selection, placements of "
              f"{t['outputs'] * world:,} chunks) {t['plan_s']:.2f} s\n"
              f"  peak RSS {t['rss_peak'] / MIB:.0f} MiB (before {t['rss_before'] / MIB:.0f} MiB, "
              f"+{t['rss_delta'] / MIB:.0f}"
              f" MiB) [{verdict(t['rss_peak'] <= PLAN_RSS)} <= {PLAN_RSS // MIB} MiB]", flush=True)
        if args.profile:
            small = max(1, world // 8)
            prof = cProfile.Profile()
            prof.enable()
            planning(small)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"cProfile of the same planning at {small} output ranks (by own time):\n{s.getvalue()}")
    finally:
        remove(scratch)
    t.update(src_ranks=args.src_ranks, dst_ranks=world, tensors=len(shapes), loadavg=loadavg(), code=code_version())
    return t


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="model + Adam state, GiB (default 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--quick", action="store_true", help="~0.25 GiB, 1 repeat (smoke run)")
    ap.add_argument("--no-check", action="store_true", help="skip the diff checks")
    ap.add_argument("--keep", action="store_true", help="with --dir: keep the two sources there, and reuse them "
                    "if they are already there (no rebuild)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--plan-70b", action="store_true", help="only time convert's planning, 70B 1024 -> 768 ranks")
    ap.add_argument("--src-ranks", type=int, default=1024, help="--plan-70b: source world size")
    ap.add_argument("--dst-ranks", type=int, default=None, help="--plan-70b: output world size (default 768; "
                    "8192 with --plan-405b)")
    ap.add_argument("--plan-405b", action="store_true", help="as --plan-70b, for Llama-3.1-405B + AdamW, 1024 -> "
                    "8192 ranks")
    ap.add_argument("--step-tensors", action="store_true", help="--plan-70b: AdamW step as 0-dim tensors")
    ap.add_argument("--profile", action="store_true", help="--plan-70b: cProfile the planning at 1/8 the ranks")
    args = ap.parse_args()
    if args.plan_70b or args.plan_405b:
        args.dst_ranks = args.dst_ranks or (8192 if args.plan_405b else 768)
        out = plan_70b(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    if args.quick:
        args.gib, args.repeats = 0.25, 1
    if not can_drop_caches():
        print("WARNING: not root: caches cannot be dropped; runs will not be cold", file=sys.stderr)
    base = args.dir or tempfile.mkdtemp(prefix="shardckpt-bench-convert-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    shapes = param_shapes(args.gib)
    total = 3 * tensor_bytes(shapes)
    shard_dir, dcp_dir = os.path.join(base, "src-shardckpt-ws4"), os.path.join(base, "src-dcp-ws4")
    print(f"{len(shapes)} params x 3 (param, exp_avg, exp_avg_sq) = {3 * len(shapes)} tensors, {total / GIB:.3f} GiB "
          f"fp32; dir {base}; {os.cpu_count()} CPUs; torch {torch.__version__}; loadavg {loadavg()}; code: "
          f"{code_version()}", flush=True)
    try:
        reuse = args.keep and args.dir and os.path.exists(os.path.join(shard_dir, "manifest.json")) and \
            os.path.exists(os.path.join(dcp_dir, ".metadata"))
        secs = 0.0 if reuse else build(shapes, shard_dir, dcp_dir)
        print(f"{'reused' if reuse else 'built'} and saved at ws {SAVE_WORLD} (shardckpt + dcp) in {secs:.1f} s: "
              f"shardckpt {du(shard_dir) / GIB:.3f} GiB, dcp {du(dcp_dir) / GIB:.3f} GiB", flush=True)
        src_check = None
        if not args.no_check:
            src_check = check_sources(shard_dir, dcp_dir)
            print(f"check: diff(shardckpt source, DCP source) equal ({src_check['tensors']} tensors by value, "
                  f"{src_check['seconds']:.1f} s)", flush=True)
        print(f"timing, cold, {args.repeats} repeats ...", flush=True)
        res = run(args, shard_dir, dcp_dir, base)
        summary = report(res, total, 3 * len(shapes), args)
        summary.update(source_check=src_check, code=code_version(),
                       date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    finally:
        if args.dir is None:
            remove(base)
        elif not args.keep:
            for d in (shard_dir, dcp_dir):
                remove(d)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
