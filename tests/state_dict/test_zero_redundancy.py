"""torch's ``ZeroRedundancyOptimizer`` (optimizer state partitioned over ranks, parameters replicated): its
consolidated ``state_dict()`` is a plain ID-keyed optimizer state in the model's parameter order (no names
recorded: ``optim_param_names`` says them), and ``load_state`` resumes it into a runtime-sharded model at another
world size, continuing the loss curve (issue 15, its first item; the per-rank partition form is not done)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import shardckpt
from shardckpt import runtime
from shardckpt.dist.group import LOCAL
from tests._dist import run_ranks
from tests.runtime import _helpers, _model

BEFORE, AFTER = 2, 3


def _zero_steps(model, opt, batches) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = _model.loss_fn(model, *_model.local_slice(batch, rank, world))
        loss.backward()
        for p in model.parameters():  # data parallel: ZeRO-1 shards the optimizer state, not the gradients
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        losses.append(loss.item())
    return _helpers.global_mean(losses)


def _train_with_zero(path: str) -> list[float]:
    model = _model.make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                  weight_decay=0.1)
    batches = _model.make_batches(BEFORE + AFTER)
    _zero_steps(model, opt, batches[:BEFORE])
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        shardckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, path, process_group=LOCAL)
    dist.barrier()
    return _zero_steps(model, opt, batches[BEFORE:])  # the uninterrupted run


def _resume_sharded(path: str) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = runtime.shard(_model.make_model(seed=9), wrap=(_model.Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    names = [n for n, _ in _model.make_model().named_parameters()]  # ZeRO's IDs: the model's parameter order
    shardckpt.load_state(model, optim, path, optim_param_names=names)
    losses = []
    for batch in _model.make_batches(BEFORE + AFTER)[BEFORE:]:
        optim.zero_grad()
        loss = _model.loss_fn(model, *_model.local_slice(batch, rank, world))
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return _helpers.global_mean(losses)


def test_a_consolidated_zero_redundancy_checkpoint_resumes_in_the_runtime_at_another_world_size(tmp_path):
    path = str(tmp_path / "zero")
    uninterrupted = run_ranks(2, _train_with_zero, path)[0]
    resumed = run_ranks(3, _resume_sharded, path)[0]
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(resumed, uninterrupted)), \
        (resumed, uninterrupted)
