"""Bytes beyond memory (issue 38): convert and export a checkpoint ~20x the memory limit, against ``cp -r`` + sync.

Workload: the transformer-shaped fp32 model of ``bench_convert.py`` with Adam state (parameters + ``exp_avg`` +
``exp_avg_sq``, ``--gib`` GiB in all, default 20; ``step`` a plain int), a SHARDED shardckpt checkpoint at ws 4,
each tensor in dim-0 chunks. It is generated in bounded memory, not saved from memory (20 GiB would not fit next to
the other tenants of a 24 GiB machine): ``convert_plan.plan_chunks`` plans the ws-4 checkpoint and
``writer.write_rank_files`` writes each chunk from ``StreamedPiece``s whose slices are views of one 64 MiB pool of
N(0, 1) values (offset per tensor and chunk), then ``save.commit`` commits it: the files, indexes, checksums and
manifest are exactly what ``shardckpt.save`` writes.

Timed, from the parent, each a subprocess from spawn to exit, the page cache dropped (root) before each, interleaved
per repeat (the order rotating):

- ``cp``: ``cp -r SRC COPY && sync`` (the copy deleted at once: the disk is shared);
- ``start``: ``python -c "import torch, shardckpt..."`` (the tools' start-up, as in ``bench_convert.py``);
- ``convert``: ``shardckpt convert SRC DST --world-size 3 --memory-limit 1GiB --quiet`` (DST deleted after it);
- ``export``: ``shardckpt export SRC EXP --memory-limit 1GiB --quiet`` (the model only, as safetensors; deleted).

Peak RSS: each command's own ``ru_maxrss`` (``demo.processes.run_measured``). The first convert and export are
checked (``diff(SRC, DST).equal``, world size 3; ``verify_export``). Everything generated is removed at the end.

    python benchmarks/bench_convert_big.py [--gib 20] [--repeats 3] [--dir /tmp/bench/big] [--json F]
    python benchmarks/bench_convert_big.py --gib 1 --repeats 1      # smoke run (~1 min)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import can_drop_caches, drop_caches, loadavg, median, remove, verdict
from bench_convert import IMPORT, child, code_version, du, param_shapes, shardckpt_cli

GIB, MIB = 1 << 30, 1 << 20
SAVE_WORLD, OUT_WORLD = 4, 3
POOL = 16 << 20  # elements of the value pool (64 MiB of fp32)
SLICE = 4 << 20  # elements per generated slice (16 MiB: whole 1 MiB checksum blocks)
RATIO_TARGET = 1.2  # convert <= 1.2x cp -r + sync


def _tree(shapes: dict, leaf) -> dict:
    model, state = {}, {}
    for name, shape in shapes.items():
        model[name] = leaf(shape)
        state[name] = {"step": 1000, "exp_avg": leaf(shape), "exp_avg_sq": leaf(shape)}
    groups = [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": list(shapes)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def generate(path: str, gib: float) -> tuple[float, int]:
    """A SHARDED ws-4 checkpoint of ``gib`` GiB at ``path``, written a slice at a time; (seconds, tensors)."""
    from shardckpt.checkpoint.agree import encoded_holds_per_rank
    from shardckpt.checkpoint.commit import commit, data_dir
    from shardckpt.checkpoint.writer import StreamedPiece, write_rank_files
    from shardckpt.format.manifest import version_for
    from shardckpt.format.tree import encode, leaves, path_name
    from shardckpt.formats.api import TensorInfo
    from shardckpt.io import open_storage
    from shardckpt.offline.convert_plan import dim0_tiled, placement, plan_chunks
    from shardckpt.offline.streams import Output

    class Marker:
        def __init__(self, shape: tuple):
            self.shape = shape

    def marker(v) -> bool:
        return isinstance(v, Marker)

    t0 = time.perf_counter()
    tree = _tree(param_shapes(gib), Marker)
    outputs = [Output(path_name(p), p, TensorInfo(path_name(p), torch.float32, m.shape, None), torch.float32)
               for p, m in leaves(tree, marker) if marker(m)]
    encoded = encode(tree, marker)
    place = functools.partial(placement, out_type="sharded", world=SAVE_WORLD, reader=None)
    tiled = functools.partial(dim0_tiled, out_type="sharded", reader=None)
    plan = plan_chunks(outputs, place, tiled, SAVE_WORLD, 2, None, uuid.uuid4().hex[:16])
    pool = torch.randn(POOL + SLICE, generator=torch.Generator().manual_seed(0))
    storage = open_storage(path)
    version = version_for(False, encoded_holds_per_rank(encoded))

    def slices(seed: int, numel: int, block: int, first: int):
        for lo in range(first, numel, SLICE):
            at = (seed * 7919 + lo) % POOL
            yield pool[at:at + min(SLICE, numel - lo)]

    results = []
    for rank in range(SAVE_WORLD):
        pieces = {}
        for i, o in enumerate(outputs):
            region = place(o, rank)[0]
            pieces[o.name] = StreamedPiece(o.name, torch.float32, tuple(o.source.shape), region,
                                           functools.partial(slices, i * SAVE_WORLD + rank, region.numel))
        results.append(write_rank_files(storage, f"{data_dir(plan.generation)}/rank-{rank:05d}", plan.tasks[rank],
                                        pieces, 2, None, version=version))
    commit(storage, plan, plan.generation, results, encoded, {}, overwrite=False)
    return time.perf_counter() - t0, len(outputs)


def generate_deepspeed(path: str, gib: float) -> tuple[float, int]:
    """A DeepSpeed ZeRO-2 checkpoint of ``gib`` GiB (fp32 partitions + Adam) at ws 4, laid out as DeepSpeed 0.1x
    writes it: ``mp_rank_00_model_states.pt`` with the bf16 module (views of one flat group buffer, as ZeRO-1/2's
    flattened parameters are), ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` with rank ``r``'s fp32 partition
    and its ``exp_avg`` / ``exp_avg_sq``. One rank's partitions are in memory at a time; (seconds, parameters)."""
    t0 = time.perf_counter()
    shapes = param_shapes(gib)
    total = sum(math.prod(s) for s in shapes.values())
    padded = total + (-total % (2 * SAVE_WORLD))
    part = padded // SAVE_WORLD
    pool = torch.randn(POOL + SLICE, generator=torch.Generator().manual_seed(0))

    def fill(out: torch.Tensor, seed: int) -> torch.Tensor:
        for lo in range(0, out.numel(), SLICE):
            at = (seed * 7919 + lo) % POOL
            n = min(SLICE, out.numel() - lo)
            out[lo:lo + n] = pool[at:at + n]
        return out

    os.makedirs(path)
    bit16 = fill(torch.empty(padded, dtype=torch.bfloat16), 1)
    module, at = {}, 0
    for name, shape in shapes.items():
        module[name] = bit16[at:at + math.prod(shape)].view(shape)
        at += math.prod(shape)
    model = {"module": module, "buffer_names": [], "param_shapes": [dict(shapes)], "frozen_param_shapes": None,
             "shared_params": {}, "dp_world_size": SAVE_WORLD, "mp_world_size": 1, "global_steps": 1000}
    torch.save(model, os.path.join(path, "mp_rank_00_model_states.pt"))
    del bit16, module, model
    for r in range(SAVE_WORLD):
        flat, avg, sq = (fill(torch.empty(part), 3 * r + k + 2) for k in range(3))
        osd = {"zero_stage": 2, "partition_count": [SAVE_WORLD], "single_partition_of_fp32_groups": [flat],
               "param_alignment_paddings": [[0] * len(shapes)],
               "base_optimizer_state": {"state": {0: {"step": torch.tensor(1000.0), "exp_avg": avg, "exp_avg_sq": sq}},
                                        "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                          "weight_decay": 0.0, "params": [0]}]}}
        torch.save({"optimizer_state_dict": osd}, os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        del flat, avg, sq, osd
    return time.perf_counter() - t0, len(shapes)


def timed(method: str, src: str, base: str, check: bool) -> dict:
    out = os.path.join(base, method)
    cli, log = shardckpt_cli(), os.path.join(base, "child")
    remove(out)
    drop_caches()
    try:
        if method == "cp":
            wall, rss, _, cpu = child(["bash", "-c", f'cp -r "{src}" "{out}" && sync'], log)
        elif method == "start":
            wall, rss, _, cpu = child([sys.executable, "-c", IMPORT], log)
        elif method == "convert":
            wall, rss, _, cpu = child([cli, "convert", src, out, "--world-size", str(OUT_WORLD), "--memory-limit",
                                       "1GiB", "--quiet"], log)
        else:
            wall, rss, _, cpu = child([cli, "export", src, out, "--memory-limit", "1GiB", "--quiet"], log)
        res = {"wall": wall, "rss": rss, "cpu": cpu}
        if check and method in ("convert", "export"):
            res["check"] = _check(method, src, out)
        return res
    finally:
        remove(out)


def _check(method: str, src: str, out: str) -> bool:
    if method == "convert":
        from shardckpt.formats.native import read_manifest
        from shardckpt.io import open_storage
        from shardckpt.offline.diff import diff

        return bool(diff(src, out).equal) and read_manifest(open_storage(out)).world_size == OUT_WORLD
    from shardckpt.offline.verify_export import verify_export

    return bool(verify_export(out, against=src).ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=20.0, help="model + Adam state, GiB (default 20)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp); removed after")
    ap.add_argument("--no-check", action="store_true", help="skip the diff / verify_export checks")
    ap.add_argument("--source", choices=("shardckpt", "deepspeed"), default="shardckpt",
                    help="the checkpoint converted: shardckpt's own (SHARDED, ws 4) or a DeepSpeed ZeRO-2 one (ws 4)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not can_drop_caches():
        print("WARNING: not root: caches cannot be dropped; runs will not be cold", file=sys.stderr)
    base = args.dir or tempfile.mkdtemp(prefix="shardckpt-bench-big-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    src = os.path.join(base, "src-ws4")
    methods = ["cp", "start", "convert", "export"]
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        make = generate if args.source == "shardckpt" else generate_deepspeed
        secs, ntensors = make(src, args.gib)
        size = du(src)
        print(f"generated {args.source}: {ntensors} tensors, {size / GIB:.2f} GiB at ws {SAVE_WORLD} in {secs:.1f} s; "
              f"{os.cpu_count()} CPUs; loadavg {loadavg()}; code: {code_version()}", flush=True)
        for rep in range(args.repeats):
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for m in order:
                r = timed(m, src, base, check=rep == 0 and not args.no_check)
                runs[m].append(r)
                print(f"  repeat {rep} {m:8s} {r['wall']:7.2f} s  CPU {r['cpu']:6.2f} s  peak RSS "
                      f"{r['rss'] / MIB:5.0f} MiB{'  check ' + verdict(r['check']) if 'check' in r else ''}  "
                      f"(loadavg {loadavg()})", flush=True)
    finally:
        remove(base if args.dir is None else src)
        for m in ("cp", "convert", "export", "child.out", "child.err"):
            remove(os.path.join(base, m))
    summary = report(runs, size, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


def report(runs: dict, size: int, args) -> dict:
    med = {m: median([r["wall"] for r in rs]) for m, rs in runs.items()}
    paired = median([c["wall"] / p["wall"] for c, p in zip(runs["convert"], runs["cp"])])
    peak = {m: max(r["rss"] for r in runs[m]) for m in ("convert", "export")}
    print(f"\n{size / GIB:.2f} GiB, medians of {args.repeats} (wall s): cp -r + sync {med['cp']:.2f} "
          f"({size / med['cp'] / MIB:.0f} MiB/s), start-up {med['start']:.2f}, convert {med['convert']:.2f}, "
          f"export {med['export']:.2f}")
    print(f"convert / (cp -r + sync) {med['convert'] / med['cp']:.2f} (paired {paired:.2f}); / (start-up + cp) "
          f"{med['convert'] / (med['start'] + med['cp']):.2f} [{verdict(med['convert'] <= RATIO_TARGET * med['cp'])} "
          f"<= {RATIO_TARGET}x cp]; export / cp {med['export'] / med['cp']:.2f}")
    for m in ("convert", "export"):
        print(f"{m} peak RSS {peak[m] / MIB:.0f} MiB [{verdict(peak[m] <= GIB)} <= 1 GiB, the --memory-limit]")
    return {"gib": size / GIB, "runs": runs, "medians": med, "convert_over_cp": med["convert"] / med["cp"],
            "paired": paired, "peak_rss": peak, "loadavg": loadavg(), "code": code_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


if __name__ == "__main__":
    main()
