"""Metadata scale: the manifest of a Llama-2-70B-shaped model with AdamW state saved by 1024 ranks, and
planning a load of it at 768 ranks, from metadata alone (no tensor data, no I/O).

Model: 80 layers, hidden 8192, intermediate 28672, vocab 32000, GQA with 8 kv heads of 128 (k/v
projections 1024 x 8192); per layer q/k/v/o, gate/up/down and 2 RMSNorms, plus embed, final norm and
lm_head: 723 parameters. AdamW adds exp_avg and exp_avg_sq per parameter (2169 tensors in all) and a
``step`` per parameter, a plain int in the tree by default (``--step-tensors``: a 0-dim fp32 tensor as
torch.optim keeps it, 2892 tensors).

Every tensor is saved FSDP-style as dim-0 chunks (``torch.chunk`` semantics) by 1024 ranks, rank r to
file r. The manifest is built as ``save`` builds it (``compact_chunks`` over the chunk regions, one
``FileEntry`` per rank, ``Manifest.to_bytes`` with the encoded tree), then parsed back with
``parse_manifest``.

Planning at 768 ranks, timed two ways for every rank in turn (one process, sequentially):

- ``plan_reads``: planned ``CheckedRequest`` targets (``formats.requests``, planned by ``formats.native.plan``)
  for the rank's dim-0 chunk (a ``Box``, as ``ShardedTensor.dim0_chunk`` gives, made canonical as
  ``check_request`` makes it) of every tensor, with a shared empty placeholder tensor as ``flat``
  (``plan_reads`` reads only ``info`` and ``region``), then ``plan_reads``. Target construction is timed
  separately.
- ``match + plan_reads``: the real load path minus I/O: a state dict of ``ShardedTensor``s over ``meta``
  tensors (building it is timed separately, it is the caller's), ``checkpoint.match`` (manifest tree vs
  state dict: read requests), the requests checked into targets, and ``plan_reads``.

``--save-plan`` also times rank 0's save planning (``make_save_plan`` over 1024 ranks' ``PieceInfo`` lists).

    python benchmarks/bench_manifest_scale.py [--save-ranks 1024] [--load-ranks 768] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import median, verdict

from shardckpt.checkpoint.match import match
from shardckpt.formats.native.plan import plan_reads
from shardckpt.formats.requests import CheckedRequest, check_request
from shardckpt.regions import Box, canonical, dim0_chunk
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.format.chunks import compact_chunks
from shardckpt.format.manifest import FileEntry, Manifest, TensorEntry, parse_manifest
from shardckpt.format.tree import encode, leaves, path_name

MIB = 1 << 20
MANIFEST_LIMIT = 16 * MIB
PLAN_LIMIT_S = 10.0


class _Leaf:
    """Stands for a tensor of ``shape`` in the metadata-only state dict."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(shape)


def llama70b_params(layers=80, hidden=8192, inter=28672, vocab=32000, kv_heads=8, head_dim=128) -> dict:
    kv = kv_heads * head_dim
    p = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        b = f"model.layers.{i}."
        p[b + "self_attn.q_proj.weight"] = (hidden, hidden)
        p[b + "self_attn.k_proj.weight"] = (kv, hidden)
        p[b + "self_attn.v_proj.weight"] = (kv, hidden)
        p[b + "self_attn.o_proj.weight"] = (hidden, hidden)
        p[b + "mlp.gate_proj.weight"] = (inter, hidden)
        p[b + "mlp.up_proj.weight"] = (inter, hidden)
        p[b + "mlp.down_proj.weight"] = (hidden, inter)
        p[b + "input_layernorm.weight"] = (hidden,)
        p[b + "post_attention_layernorm.weight"] = (hidden,)
    p["model.norm.weight"] = (hidden,)
    p["lm_head.weight"] = (vocab, hidden)
    return p


def state_tree(params: dict, step_tensors: bool, leaf=lambda name, shape: _Leaf(shape)) -> dict:
    """``{"model": ..., "optim": {"state": ..., "param_groups": ...}}`` with ``leaf(name, shape)`` for tensors."""
    model = {k: leaf("model." + k, s) for k, s in params.items()}
    state = {}
    for k, s in params.items():
        base = f"optim.state.{k}."
        state[k] = {"step": leaf(base + "step", ()) if step_tensors else 1000,
                    "exp_avg": leaf(base + "exp_avg", s), "exp_avg_sq": leaf(base + "exp_avg_sq", s)}
    groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "params": list(params)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def tensor_shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    return {path_name(p): v.shape for p, v in leaves(tree, lambda v: isinstance(v, _Leaf)) if isinstance(v, _Leaf)}


def save_regions(shapes: dict, world: int) -> dict[str, tuple[list, list]]:
    """Per tensor, the chunk regions (canonical, as the save plan holds them) and the file of each."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if not shape:  # a 0-dim tensor is replicated; save spreads those over ranks
            out[name] = ([dim0_chunk(shape, 0, 1)], [i % world])
            continue
        regions, files = [], []
        for r in range(world):
            region = dim0_chunk(shape, r, world)
            if region.numel:
                regions.append(region)
                files.append(r)
        out[name] = (regions, files)
    return out


def build_manifest(shapes: dict, regions: dict, world: int) -> tuple[Manifest, dict]:
    """The manifest ``save`` commits: ``compact_chunks`` per tensor (as ``TensorPlan.chunks``), one file per rank."""
    generation = "0123456789abcdef"
    file_bytes = [0] * world
    tensors = {}
    stats = {"regular": 0, "explicit": 0}
    for i, (name, shape) in enumerate(shapes.items()):
        regs, files = regions[name]
        chunks = compact_chunks(regs, files, shape)
        stats["regular" if type(chunks).__name__ == "RegularChunks" else "explicit"] += 1
        tensors[name] = TensorEntry(name, torch.float32, tuple(shape), (i * 2654435761) & 0xFFFFFFFF, chunks)
        for reg, f in zip(regs, files):
            file_bytes[f] += reg.numel * 4
    files = [FileEntry(f"data-{generation}/rank-{r:05d}.bin", file_bytes[r], f"data-{generation}/rank-{r:05d}.index.json",
                       4096 + 60 * len(shapes), (r * 40503) & 0xFFFFFFFF) for r in range(world)]
    return Manifest(world_size=world, generation=generation, tree=None, tensors=tensors, files=files,
                    metadata={"step": 1000}, created_by="shardckpt bench"), stats


def profile_sample(fn, ranks, top: int = 15) -> str:
    """cProfile ``fn(rank)`` over a sample of ranks; the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for r in ranks:
        fn(r)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def _box_chunk(shape: tuple, rank: int, world: int):
    """The region ``ShardedTensor.dim0_chunk`` gives rank ``rank`` of ``world`` (a Box; 0-dim: whole)."""
    if not shape:
        return Box((), ())
    rows = -(-shape[0] // world)
    first, last = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
    return Box((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:]))


def plan_direct(manifest: Manifest, rank: int, world: int, placeholder: torch.Tensor) -> tuple[float, float, int]:
    """Build this rank's targets directly and plan; returns (target build s, plan_reads s, reads)."""
    t0 = time.perf_counter()
    targets = []
    for name, entry in manifest.tensors.items():
        region = _box_chunk(entry.shape, rank, world)
        if region.numel:
            targets.append(CheckedRequest(entry, canonical(region, entry.shape), placeholder))
    t1 = time.perf_counter()
    reads = plan_reads(targets)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(reads)


def meta_state_dict(params: dict, step_tensors: bool, rank: int, world: int) -> dict:
    def leaf(name, shape):
        if not shape:
            return torch.empty((), device="meta")
        region = _box_chunk(shape, rank, world)
        return ShardedTensor.dim0_chunk(torch.empty(region.sizes, device="meta"), shape, rank, world)
    return state_tree(params, step_tensors, leaf)


def plan_via_match(manifest: Manifest, sd: dict) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    targets = [check_request(manifest.tensors, r, "bench") for r in match(manifest.tree, manifest.tensors, sd, strict=True).requests]
    t1 = time.perf_counter()
    reads = plan_reads(targets)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(reads)


def PieceInfo_of(name: str, shape: tuple, rank: int, world: int):
    """What rank ``rank`` of ``world`` sends rank 0 for its dim-0 chunk of ``name`` (a plain 0-dim tensor: replicated)."""
    from shardckpt.checkpoint.collect import region_key
    from shardckpt.checkpoint.save_plan import PieceInfo

    if not shape:
        return PieceInfo(name, "float32", shape, ("flat", 0, 1), True, True)
    return PieceInfo(name, "float32", shape, region_key(_box_chunk(shape, rank, world), shape), False, True)


def time_save_plan(shapes: dict, world: int) -> dict:
    from shardckpt.checkpoint.save_plan import make_save_plan

    t0 = time.perf_counter()
    infos = [[PieceInfo_of(name, shape, r, world) for name, shape in shapes.items()] for r in range(world)]
    t1, c1 = time.perf_counter(), time.process_time()
    plan = make_save_plan(infos, "0123456789abcdef")
    t2 = time.perf_counter()
    return {"build_infos_s": t1 - t0, "make_save_plan_s": t2 - t1, "make_save_plan_cpu_s": time.process_time() - c1,
            "tasks": sum(len(t) for t in plan.tasks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-ranks", type=int, default=1024)
    ap.add_argument("--load-ranks", type=int, default=768)
    ap.add_argument("--step-tensors", action="store_true", help="AdamW step as 0-dim tensors (2892 tensors)")
    ap.add_argument("--skip-match", action="store_true", help="skip the match + plan_reads pass")
    ap.add_argument("--save-plan", action="store_true", help="also time make_save_plan at --save-ranks")
    ap.add_argument("--profile", action="store_true", help="always print cProfile tables (they are printed "
                    "anyway for a pass over 10 s); timed passes are never profiled")
    ap.add_argument("--profile-ranks", type=int, default=32, help="ranks sampled for the profile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict = {"save_ranks": args.save_ranks, "load_ranks": args.load_ranks, "step_tensors": args.step_tensors}

    params = llama70b_params()
    tree = state_tree(params, args.step_tensors)
    shapes = tensor_shapes(tree)
    numel = sum(math.prod(s) for s in shapes.values())
    print(f"{len(params)} params, {len(shapes)} tensors, {numel / 1e9:.2f} G elements "
          f"({numel * 4 / (1 << 30):.0f} GiB fp32), saved by {args.save_ranks} ranks", flush=True)

    regions = save_regions(shapes, args.save_ranks)
    t0, c0 = time.perf_counter(), time.process_time()
    manifest, stats = build_manifest(shapes, regions, args.save_ranks)
    t1, c1 = time.perf_counter(), time.process_time()
    del regions
    encoded = encode(tree, lambda v: isinstance(v, _Leaf))
    data = manifest.to_bytes(encoded)
    t2 = time.perf_counter()
    parse_times = []
    for _ in range(3):
        p0 = time.perf_counter()
        parsed = parse_manifest(data, "bench manifest.json")
        parse_times.append(time.perf_counter() - p0)
    assert set(parsed.tensors) == set(shapes) and len(parsed.files) == args.save_ranks
    out.update(tensors=len(shapes), manifest_bytes=len(data), build_entries_s=t1 - t0, build_entries_cpu_s=c1 - c0, to_bytes_s=t2 - t1,
               parse_s=median(parse_times), chunk_kinds=stats)
    print(f"manifest: {len(data):,} bytes ({len(data) / MIB:.2f} MiB) [{verdict(len(data) <= MANIFEST_LIMIT)} "
          f"<= 16 MiB]; chunk tables {stats}; compact_chunks + entries (rank 0 at commit) {t1 - t0:.2f} s (CPU {c1 - c0:.2f} s), to_bytes {t2 - t1:.3f} s, "
          f"parse_manifest {median(parse_times):.3f} s (median of 3)", flush=True)

    world = args.load_ranks
    placeholder = torch.empty(0)
    build, plan, nreads = [], [], 0
    cpu0 = time.process_time()
    for r in range(world):
        b, p, n = plan_direct(parsed, r, world, placeholder)
        build.append(b)
        plan.append(p)
        nreads += n
    cpu_direct = time.process_time() - cpu0
    total_direct = sum(build) + sum(plan)
    out["direct"] = {"cpu_s": cpu_direct, "targets_s": sum(build), "plan_reads_s": sum(plan), "total_s": total_direct,
                     "per_rank_median_s": median([b + p for b, p in zip(build, plan)]),
                     "per_rank_max_s": max(b + p for b, p in zip(build, plan)), "reads": nreads}
    print(f"plan at {world} ranks (targets + plan_reads): all ranks {total_direct:.2f} s "
          f"(targets {sum(build):.2f} s + plan_reads {sum(plan):.2f} s) [{verdict(total_direct <= PLAN_LIMIT_S)} "
          f"<= 10 s] (process CPU time {cpu_direct:.2f} s [{verdict(cpu_direct <= PLAN_LIMIT_S)}]); per rank median "
          f"{out['direct']['per_rank_median_s'] * 1e3:.1f} ms, "
          f"max {out['direct']['per_rank_max_s'] * 1e3:.1f} ms; {nreads:,} chunk reads", flush=True)
    sample = range(0, world, max(1, world // args.profile_ranks))
    if args.profile or total_direct > PLAN_LIMIT_S:
        print(f"cProfile of targets + plan_reads over {len(sample)} sampled ranks:")
        print(profile_sample(lambda r: plan_direct(parsed, r, world, placeholder), sample))

    if not args.skip_match:
        sd_build, m_times, p_times, cpu_match = [], [], [], 0.0
        for r in range(world):
            b0 = time.perf_counter()
            sd = meta_state_dict(params, args.step_tensors, r, world)
            sd_build.append(time.perf_counter() - b0)
            c0 = time.process_time()
            m, p, _ = plan_via_match(parsed, sd)
            cpu_match += time.process_time() - c0
            m_times.append(m)
            p_times.append(p)
        total = sum(m_times) + sum(p_times)
        out["match"] = {"cpu_s": cpu_match, "state_dict_build_s": sum(sd_build), "match_s": sum(m_times), "plan_reads_s": sum(p_times),
                        "total_s": total, "per_rank_median_s": median([m + p for m, p in zip(m_times, p_times)])}
        print(f"plan at {world} ranks (match + plan_reads, meta ShardedTensors): all ranks {total:.2f} s "
              f"(match {sum(m_times):.2f} s + plan_reads {sum(p_times):.2f} s) [{verdict(total <= PLAN_LIMIT_S)} "
              f"<= 10 s] (process CPU time {cpu_match:.2f} s); per rank median "
              f"{out['match']['per_rank_median_s'] * 1e3:.1f} ms; "
              f"(building the meta state dicts, not counted: {sum(sd_build):.2f} s)", flush=True)
        if args.profile or total > PLAN_LIMIT_S:
            sds = {r: meta_state_dict(params, args.step_tensors, r, world) for r in sample}
            print(f"cProfile of match + plan_reads over {len(sample)} sampled ranks:")
            print(profile_sample(lambda r: plan_via_match(parsed, sds[r]), sample))
            del sds

    if args.save_plan:
        sp = time_save_plan(shapes, args.save_ranks)
        out["save_plan"] = sp
        if args.profile or sp["make_save_plan_s"] > PLAN_LIMIT_S:
            from shardckpt.checkpoint.save_plan import make_save_plan
            small = max(1, args.save_ranks // 8)
            infos = [[PieceInfo_of(name, shape, r, small) for name, shape in shapes.items()] for r in range(small)]
            print(f"cProfile of make_save_plan at {small} ranks:")
            print(profile_sample(lambda _: make_save_plan(infos, "0123456789abcdef"), [0]))
        print(f"save plan at {args.save_ranks} ranks: make_save_plan {sp['make_save_plan_s']:.2f} s "
              f"(CPU {sp['make_save_plan_cpu_s']:.2f} s) "
              f"(building the {args.save_ranks} PieceInfo lists, not counted: {sp['build_infos_s']:.2f} s)", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
