"""Peak memory of the runtime (issue 14): activation checkpointing, and sharding a model built on ``meta``.

Each configuration runs in its own 2 spawned gloo ranks (127.0.0.1, CPU), so that each rank's peak RSS (VmHWM)
is that configuration's own; reported per rank and as the ratio to the baseline configuration.

- ``activations``: a stack of ``--layers`` residual MLP blocks (d ``--dim``, hidden 4d), one unit each, FULL_SHARD,
  trained ``--steps`` AdamW steps on a batch of ``--tokens`` tokens per rank: activations (tokens x 4d per block)
  dominate the parameters. Without checkpointing, and with ``torch.utils.checkpoint.checkpoint`` around each
  block's body inside its forward (non-reentrant, the form transformers uses). The losses must agree exactly.
- ``init``: the same stack, bigger (``--init-layers``), sharded at ws 2 when built on the CPU (the whole model
  exists first) and when built on the ``meta`` device (``param_init_fn``: each unit materialised, sharded and
  dropped in turn). The sharded weights must agree exactly.

    python benchmarks/bench_runtime_memory.py                 # ~1 min
    python benchmarks/bench_runtime_memory.py --json /tmp/bench/runtime_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp
from torch import nn

MIB = 1 << 20


class Block(nn.Module):
    def __init__(self, dim: int, checkpointing: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.checkpointing = checkpointing

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing:
            return x + torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return x + self.body(x)


def stack(layers: int, dim: int, checkpointing: bool = False) -> nn.Sequential:
    return nn.Sequential(*(Block(dim, checkpointing) for _ in range(layers)))


def init_module(module: nn.Module) -> None:
    """Materialise one module's own tensors with values fixed by its shape (the same on meta and on the CPU)."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for t in module.parameters(recurse=False):
            g = torch.Generator().manual_seed(sum(t.shape))
            t.copy_(torch.randn(t.shape, generator=g) * 0.02)


def peak_rss() -> int:
    """This process's peak resident memory since it started (VmHWM; ``ru_maxrss`` of a spawned child can carry
    its parent's peak from before exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, port: int, config: dict, out: str) -> None:
    import torch.distributed as dist

    from shardckpt import runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    result: dict = {}
    if config["kind"] == "activations":
        model = runtime.shard(stack(config["layers"], config["dim"], config["checkpointing"]), wrap=(Block,))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(config["tokens"], config["dim"], generator=g)
        losses = []
        for _ in range(config["steps"]):
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        result["losses"] = losses
    else:
        if config["meta"]:
            with torch.device("meta"):
                model = stack(config["layers"], config["dim"])
            model = runtime.shard(model, wrap=(Block,), device="cpu", param_init_fn=init_module)
        else:
            model = stack(config["layers"], config["dim"])
            for module in model.modules():
                init_module(module)
            model = runtime.shard(model, wrap=(Block,))
        result["shard_sum"] = float(sum(g.flat_param.detach().double().sum() for g in runtime.groups(model)))
    result["peak_rss"] = peak_rss()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run(config: dict, world: int = 2) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_rank, args=(world, port, config, out), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    return results


def compare(base_label: str, base: list[dict], other_label: str, other: list[dict], same_key: str) -> dict:
    """Print both configurations' peak RSS per rank and their ratio; whether ``same_key`` agrees on every rank."""
    for label, results in ((base_label, base), (other_label, other)):
        peaks = ", ".join(f"{r['peak_rss'] / MIB:.0f} MiB" for r in results)
        print(f"  {label:30s} peak RSS per rank: {peaks}")
    same = all(a[same_key] == b[same_key] for a, b in zip(base, other))
    ratio = max(r["peak_rss"] for r in other) / max(r["peak_rss"] for r in base)
    print(f"  {other_label} / {base_label} peak = {ratio:.2f}; {same_key} identical: {same}")
    return {"ratio": ratio, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--init-layers", type=int, default=16)
    ap.add_argument("--init-dim", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report: dict = {}
    act = {"kind": "activations", "layers": args.layers, "dim": args.dim, "tokens": args.tokens, "steps": args.steps}
    plain, ckpt = run({**act, "checkpointing": False}), run({**act, "checkpointing": True})
    params = args.layers * (8 * args.dim * args.dim + 7 * args.dim) * 4
    acts = args.layers * args.tokens * 4 * args.dim * 4 * 2  # up and gelu outputs per block, fp32
    print(f"activations: {args.layers} blocks d={args.dim} (params {params / MIB:.0f} MiB), {args.tokens} tokens per "
          f"rank (~{acts / MIB:.0f} MiB of the blocks' hidden activations), FULL_SHARD, ws 2, {args.steps} steps")
    report["activations"] = {"config": act, "plain": plain, "checkpointed": ckpt,
                             **compare("without checkpointing", plain, "checkpointed", ckpt, "losses")}

    init = {"kind": "init", "layers": args.init_layers, "dim": args.init_dim}
    cpu, meta = run({**init, "meta": False}), run({**init, "meta": True})
    size = args.init_layers * (8 * args.init_dim ** 2 + 7 * args.init_dim) * 4
    print(f"init: {args.init_layers} blocks d={args.init_dim} ({size / MIB:.0f} MiB of fp32 parameters), sharded at ws 2")
    report["init"] = {"config": init, "cpu": cpu, "meta": meta,
                      **compare("built on the CPU", cpu, "built on meta", meta, "shard_sum")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not all(part["same"] for part in report.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
