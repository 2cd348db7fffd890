"""Step time and memory of ``use_orig_params`` (issue 20) next to the flat form, and torch's FSDP2, on CPU.

Each configuration runs in its own 2 spawned gloo ranks (127.0.0.1, one thread each), so that each rank's peak
RSS (VmHWM) is that configuration's own. The model is ``runtime_step.py``'s GPT (one unit per block, the root
holding the tied embedding/head and the final norm), FULL_SHARD, AdamW, fp32:

- ``flat``: ``shard(model)``, ``AdamW(model.parameters())``: one flat shard per unit, one param group;
- ``orig``: ``shard(model, use_orig_params=True)``, the same single group over the original parameters'
  pieces: the same arithmetic, so its losses must equal ``flat``'s bit for bit (checked);
- ``orig+groups``: the same with the decay recipe (weight decay on 2-D parameters except norms', none on
  the rest), what the issue is for;
- ``fsdp2+groups``: torch's ``fully_shard`` per block and at the root, the same recipe on its DTensors.

Configurations are interleaved within each repeat; reported: the median over repeats of each run's median
step time (after warm-up), the peak RSS per rank, and the ratios to ``flat``.

    python benchmarks/bench_orig_params.py                   # ~10 min on 2 cores
    python benchmarks/bench_orig_params.py --quick           # ~40 s
    python benchmarks/bench_orig_params.py --json /tmp/bench/orig.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from bench_runtime_memory import peak_rss
from runtime_step import GPT, Block, Config, decay_groups

MIB = 1 << 20
FORMS = ("flat", "orig", "orig+groups", "fsdp2+groups")


def build(form: str, cfg: Config) -> tuple[nn.Module, torch.optim.Optimizer]:
    from shardckpt import runtime

    torch.manual_seed(0)
    model = GPT(cfg)
    if form == "fsdp2+groups":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = runtime.shard(model, wrap=(Block,), use_orig_params=form != "flat")
    groups = decay_groups(model) if form.endswith("+groups") else [{"params": list(model.parameters())}]
    return model, torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.1)


def _rank(rank: int, world: int, port: int, form: str, cfg: Config, steps: int, warmup: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, optim = build(form, cfg)
    gen = torch.Generator().manual_seed(1 + rank)
    times, losses = [], []
    for step in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        start = time.perf_counter()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    tensors = sum(len(pg["params"]) for pg in optim.param_groups)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"step_s": statistics.median(times), "losses": losses, "peak_rss": peak_rss(),
                   "optimizer_tensors": tensors}, f)
    dist.destroy_process_group()


def run(form: str, cfg: Config, steps: int, warmup: int, world: int = 2) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_rank, args=(world, port, form, cfg, steps, warmup, out), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smaller model, 1 repeat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = Config(vocab=8192, dim=512, heads=8, layers=6, seq=256, batch=4)
    if args.quick:
        cfg, args.repeats, args.steps = Config(vocab=1024, dim=256, heads=4, layers=4, seq=128, batch=4), 1, 4
    params = cfg.vocab * cfg.dim + cfg.layers * (12 * cfg.dim ** 2 + 4 * cfg.dim) + 2 * cfg.dim
    print(f"{cfg}: {params / 1e6:.1f}M parameters ({params * 4 / MIB:.0f} MiB fp32), FULL_SHARD, ws 2, "
          f"{args.steps} steps after {args.warmup} warm-up, {args.repeats} repeats", flush=True)
    runs: dict[str, list[list[dict]]] = {form: [] for form in FORMS}
    for repeat in range(args.repeats):
        order = FORMS[repeat % len(FORMS):] + FORMS[:repeat % len(FORMS)]
        for form in order:
            runs[form].append(run(form, cfg, args.steps, args.warmup))
    report = {"config": cfg.__dict__, "forms": {}}
    flat_step = statistics.median(max(r["step_s"] for r in rep) for rep in runs["flat"])
    flat_peak = statistics.median(max(r["peak_rss"] for r in rep) for rep in runs["flat"])
    for form in FORMS:
        step = statistics.median(max(r["step_s"] for r in rep) for rep in runs[form])
        peak = statistics.median(max(r["peak_rss"] for r in rep) for rep in runs[form])
        tensors = runs[form][0][0]["optimizer_tensors"]
        all_steps = [round(max(r["step_s"] for r in rep) * 1e3, 1) for rep in runs[form]]
        print(f"  {form:13s} step {step * 1e3:7.1f} ms ({step / flat_step:.3f}x flat; runs {all_steps}), peak RSS "
              f"{peak / MIB:6.0f} MiB ({peak / flat_peak:.3f}x flat), {tensors} optimizer tensors", flush=True)
        report["forms"][form] = {"step_s": step, "peak_rss": peak, "step_ratio": step / flat_step,
                                 "peak_ratio": peak / flat_peak, "optimizer_tensors": tensors, "runs": runs[form]}
    same = all(a["losses"] == b["losses"] for rf, ro in zip(runs["flat"], runs["orig"]) for a, b in zip(rf, ro))
    print(f"  orig losses identical to flat: {same}")
    report["orig_losses_identical"] = same
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
