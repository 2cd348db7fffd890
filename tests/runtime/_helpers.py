"""Helpers run inside the ranks: reference runs, torch FSDP2 runs, and reading full parameters back."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardckpt import runtime
from tests.runtime import _model
from tests.runtime._model import Block

HYBRID_MESH = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}  # (replicate, shard)


def mesh_for(strategy: runtime.ShardingStrategy, world: int) -> Any:
    """The DeviceMesh a strategy runs on in these tests (None: let shard() use the default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy is runtime.ShardingStrategy.HYBRID_SHARD:
        return init_device_mesh("cpu", HYBRID_MESH[world], mesh_dim_names=("replicate", "shard"))
    return None


def full_params(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the full parameters of a model sharded by shardckpt, by original name."""
    with runtime.summon_full_params(model, writeback=False):
        return {name: model.get_submodule(name.rpartition(".")[0]).__dict__[name.rpartition(".")[2]].clone()
                for name in names}


def global_mean(values: list[float]) -> list[float]:
    """Average per-step local losses over all ranks (every rank has the same number of samples)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def reference_run(steps: int, clip: float | None = None) -> dict[str, Any]:
    """Single-process, unsharded fp32 training on the whole global batch."""
    model = _model.make_model()
    clip_fn = None if clip is None else (lambda: clip_both(
        lambda max_norm, p: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, p), clip))
    losses, norms = _model.train(model, _model.make_batches(steps), clip=clip_fn)
    return {"losses": losses, "norms": norms,  # norms: per step, (inf-norm, 2-norm)
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def clip_both(clip: Any, max_norm: float) -> tuple[float, float]:
    """The inf-norm (without clipping), then the 2-norm clipped to `max_norm`."""
    return float(clip(1e9, float("inf"))), float(clip(max_norm, 2.0))


def torch_fsdp2_run(strategy: runtime.ShardingStrategy, steps: int, bf16: bool = False,
                    prepare: Callable[[nn.Module], Any] | None = None) -> dict[str, Any]:
    """The same training with torch's own `fully_shard`, mapped from our strategy names; ``prepare(model)``
    changes the model first (activation checkpointing); torch's checkpoint wrappers stay out of the names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    shape = {runtime.ShardingStrategy.NO_SHARD: (world, 1),
             runtime.ShardingStrategy.HYBRID_SHARD: HYBRID_MESH[world]}.get(strategy, (world,))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    reshard = strategy is not runtime.ShardingStrategy.SHARD_GRAD_OP
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    model = _model.make_model()
    names = [n for n, _ in model.named_parameters()]
    if prepare is not None:
        prepare(model)
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    losses, _ = _model.train(model, _model.make_batches(steps), rank=rank, world=world)
    params = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    return {"losses": global_mean(losses), "params": {n: params[n].full_tensor().detach().clone() for n in names}}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest absolute difference over parameters present in both, and where."""
    worst = max(((a[n].float() - b[n].float()).abs().max().item(), n) for n in a)
    if set(a) != set(b):
        raise AssertionError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    return worst
