"""One training step of a GPT-style transformer: shardckpt.runtime vs torch's FSDP2 (`fully_shard`).

    python benchmarks/runtime_step.py                       # one process (CPU: small config)
    torchrun --nproc-per-node 8 benchmarks/runtime_step.py  # 8 ranks (CUDA: ~1B parameters, bf16)
    python benchmarks/runtime_step.py --config small --steps 10 --strategy SHARD_GRAD_OP
    python benchmarks/runtime_step.py --orig-params         # the flat form vs use_orig_params (decay groups)

Both runs use the same model, data, wrapping (one group per block, the root holding embeddings,
final norm and the tied head), AdamW and mixed precision (bf16 compute, fp32 reduce on CUDA; fp32
on CPU). Prints the median step time of each on rank 0, and their ratio (ours / FSDP2; < 1 is faster).
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardckpt import runtime


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int


CONFIGS = {
    "small": Config(vocab=1024, dim=256, heads=4, layers=4, seq=128, batch=4),
    "1b": Config(vocab=32000, dim=2048, heads=16, layers=18, seq=2048, batch=2),  # ~0.97B parameters
}


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_distributed(device: torch.device) -> None:
    if "RANK" not in os.environ:  # a plain `python` run: a world of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_group(model: nn.Module) -> list[dict]:
    return [{"params": list(model.parameters())}]


def decay_groups(model: nn.Module) -> list[dict]:
    """The decay recipe of every LLM codebase: weight decay on 2-D parameters except norms', none on the rest."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)}
    params = [p for _, p in model.named_parameters()]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in norms]
    rest = [p for p in params if not (p.dim() >= 2 and id(p) not in norms)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _time_steps(model: nn.Module, cfg: Config, device: torch.device, steps: int, warmup: int,
                groups: Callable[[nn.Module], list[dict]] = one_group) -> list[float]:
    optim = torch.optim.AdamW(groups(model), lr=1e-4)
    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    times = []
    for step in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(device)
        _sync(device)
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _build_ours(cfg: Config, device: torch.device, strategy: str, bf16: bool, orig: bool = False) -> nn.Module:
    mp = runtime.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    with torch.device(device):
        model = GPT(cfg)
    return runtime.shard(model, strategy=runtime.ShardingStrategy[strategy], wrap=(Block,), mixed_precision=mp,
                         use_orig_params=orig)


def _build_fsdp2(cfg: Config, device: torch.device, strategy: str, bf16: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if strategy == "NO_SHARD":  # FSDP2's form of it: HSDP replicating over every rank, shards of one rank
        mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    with torch.device(device):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=strategy == "FULL_SHARD", mp_policy=mp)
    return fully_shard(model, mesh=mesh, reshard_after_forward=strategy == "FULL_SHARD", mp_policy=mp)


def _measure(name: str, build: Callable[[], nn.Module], cfg: Config, device: torch.device,
             steps: int, warmup: int, groups: Callable[[nn.Module], list[dict]] = one_group) -> float:
    # The previous run's model, optimizer and hooks hold reference cycles: collect them, or their GPU memory
    # counts in this run's peak.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    torch.manual_seed(0)
    model = build()
    median = statistics.median(_time_steps(model, cfg, device, steps, warmup, groups))
    if dist.get_rank() == 0:
        peak = (f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (held before: "
                f"{start / 2**30:.2f} GiB)") if device.type == "cuda" else ""
        print(f"{name:>10}: median step {median * 1e3:9.1f} ms over {steps} steps{peak}", flush=True)
    del model
    return median


def _compare_orig_params(cfg: Config, device: torch.device, args: argparse.Namespace, bf16: bool) -> None:
    """``use_orig_params`` (issue 20) next to the flat form: the same single group (the same arithmetic), the
    decay recipe's two groups over the original parameters, and FSDP2 with that recipe."""
    forms = [("flat", lambda: _build_ours(cfg, device, args.strategy, bf16), one_group),
             ("orig", lambda: _build_ours(cfg, device, args.strategy, bf16, orig=True), one_group),
             ("orig+groups", lambda: _build_ours(cfg, device, args.strategy, bf16, orig=True), decay_groups),
             ("FSDP2+groups", lambda: _build_fsdp2(cfg, device, args.strategy, bf16), decay_groups)]
    times = {name: _measure(name, build, cfg, device, args.steps, args.warmup, groups) for name, build, groups in forms}
    if dist.get_rank() == 0:
        print("     ratios to flat: " + ", ".join(f"{n} {t / times['flat']:.3f}" for n, t in times.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), help="default: 1b on CUDA, small on CPU")
    parser.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--orig-params", action="store_true",
                        help="the flat form against use_orig_params=True (one group; decay groups) and FSDP2 with "
                             "the decay groups")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _init_distributed(device)
    cfg = CONFIGS[args.config or ("1b" if cuda else "small")]
    if dist.get_rank() == 0:
        print(f"{cfg} on {device.type} x {dist.get_world_size()} ranks, {args.strategy}, "
              f"{'bf16 compute' if cuda else 'fp32'}", flush=True)
    if args.orig_params:
        _compare_orig_params(cfg, device, args, cuda)
    else:
        ours = _measure("shardckpt", lambda: _build_ours(cfg, device, args.strategy, cuda), cfg, device,
                        args.steps, args.warmup)
        theirs = _measure("FSDP2", lambda: _build_fsdp2(cfg, device, args.strategy, cuda), cfg, device,
                          args.steps, args.warmup)
        if dist.get_rank() == 0:
            print(f"     ratio: {ours / theirs:.3f} (shardckpt / FSDP2)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
