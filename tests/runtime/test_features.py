"""Mixed precision, clip_grad_norm_, no_sync, summon_full_params, emulated collectives, LOCAL shards."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardckpt import runtime
from shardckpt.dist import collectives
from shardckpt.runtime import MixedPrecision, ShardingStrategy
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


def _mixed_precision() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _helpers.reference_run(5)
    model = runtime.shard(_model.make_model(), wrap=(Block,), mixed_precision=BF16)
    losses, _ = _model.train(model, _model.make_batches(5), rank=rank, world=world)
    dtypes = {g.flat_param.dtype for g in runtime.groups(model)} | {model.blocks[0].mask.dtype}
    fsdp2 = _helpers.torch_fsdp2_run(ShardingStrategy.FULL_SHARD, 5, bf16=True)
    params = _helpers.full_params(model, list(reference["params"]))
    return {"losses": _helpers.global_mean(losses), "reference_losses": reference["losses"],
            "fsdp2_losses": fsdp2["losses"], "master_dtypes": sorted(map(str, dtypes)),
            "vs_reference": _helpers.max_param_diff(params, reference["params"]),
            "vs_fsdp2": _helpers.max_param_diff(params, fsdp2["params"])}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_compute_stays_near_fp32(world_size: int) -> None:
    result = run_ranks(world_size, _mixed_precision)[0]
    assert result["master_dtypes"] == ["torch.bfloat16", "torch.float32"]  # the buffer, the masters
    torch.testing.assert_close(result["losses"], result["reference_losses"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(result["losses"], result["fsdp2_losses"], rtol=1e-2, atol=1e-2)
    assert result["vs_reference"][0] < 3e-2, result["vs_reference"]
    assert result["vs_fsdp2"][0] < 2e-2, result["vs_fsdp2"]


def _clip() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _helpers.reference_run(3, clip=0.3)
    model = runtime.shard(_model.make_model(), wrap=(Block,))
    losses, norms = _model.train(model, _model.make_batches(3), rank=rank, world=world,
                                 clip=lambda: _helpers.clip_both(model.clip_grad_norm_, 0.3))
    return {"norms": norms, "reference_norms": reference["norms"],
            "losses": _helpers.global_mean(losses), "reference_losses": reference["losses"]}


def _flat_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [g.flat_param.grad.clone() for g in runtime.groups(model) if g.flat_param.grad is not None]


def _no_sync_matches_big_batch(strategy: ShardingStrategy) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    ids, targets = _model.local_slice(_model.make_batches(1)[0], rank, world)
    n = ids.shape[0]
    half = n // 2
    mesh = _helpers.mesh_for(strategy, world)
    big = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,), process_group=mesh)
    _model.loss_fn(big, ids, targets).backward()
    accum = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,), process_group=mesh)
    with accum.no_sync():
        (_model.loss_fn(accum, ids[:half], targets[:half]) * (half / n)).backward()
    assert all(g.flat_param.grad is None for g in runtime.groups(accum)), "no_sync communicated"
    (_model.loss_fn(accum, ids[half:], targets[half:]) * ((n - half) / n)).backward()
    return max((a - b).abs().max().item() for a, b in zip(_flat_grads(big), _flat_grads(accum)))


def _summon_writeback() -> dict[str, Any]:
    model = runtime.shard(_model.make_model(), wrap=(Block,))
    reference = _model.make_model()
    with torch.no_grad():
        reference.head.weight.add_(0.5)  # tied: the token embedding moves too
        reference.blocks[1].gate.mul_(3.0)
    before = [g.flat_param.detach().clone() for g in runtime.groups(model)]
    with model.summon_full_params(writeback=False):
        model.head.weight.add_(100.0)
    unchanged = all(torch.equal(a, g.flat_param) for a, g in zip(before, runtime.groups(model)))
    with model.summon_full_params(writeback=True):
        model.head.weight.add_(0.5)
        model.blocks[1].gate.mul_(3.0)
    names = [n for n, _ in reference.named_parameters()]
    got = _helpers.full_params(model, names)
    ids, targets = _model.make_batches(1)[0]
    with torch.no_grad():
        loss_gap = abs(_model.loss_fn(model, ids, targets).item() - _model.loss_fn(reference, ids, targets).item())
    return {"unchanged_without_writeback": unchanged, "loss_gap": loss_gap,
            "param_gap": _helpers.max_param_diff(got, dict(reference.named_parameters()))}


def _emulated_collectives() -> float:
    """Training with reduce-scatter and all-gather emulated gives the native result."""
    world, rank = dist.get_world_size(), dist.get_rank()
    runs = []
    for emulate in (False, True):
        if emulate:
            collectives._EMULATED.update({("gloo", "all_gather"), ("gloo", "reduce_scatter")})
        try:
            model = runtime.shard(_model.make_model(), wrap=(Block,))
            _model.train(model, _model.make_batches(2), rank=rank, world=world)
            runs.append([g.flat_param.detach() for g in runtime.groups(model)])
        finally:
            collectives._EMULATED.clear()
    return max((a - b).abs().max().item() for a, b in zip(*runs))


def _gathered_after(strategy: ShardingStrategy) -> dict[str, list[bool]]:
    """Which groups hold a gathered buffer after forward, after backward, and after a no_grad forward."""
    model = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,))
    ids, targets = _model.make_batches(1)[0]
    state = {}
    loss = _model.loss_fn(model, ids, targets)
    state["forward"] = [g.unsharded for g in runtime.groups(model)]
    loss.backward()
    state["backward"] = [g.unsharded for g in runtime.groups(model)]
    with torch.no_grad():
        _model.loss_fn(model, ids, targets)
    state["no_grad"] = [g.unsharded for g in runtime.groups(model)]
    return state


def _prefetches() -> list[int]:
    """Per training step, how many all-gathers were issued asynchronously (prefetches)."""
    native, counts = collectives.all_gather, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts[-1] += bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))
        return native(*args, **kwargs)

    model = runtime.shard(_model.make_model(), wrap=(Block,))
    collectives.all_gather = counting
    try:
        for batch in _model.make_batches(2):
            counts.append(0)
            _model.loss_fn(model, *_model.local_slice(batch, dist.get_rank(), dist.get_world_size())).backward()
    finally:
        collectives.all_gather = native
    return counts


def _hybrid_group_forms() -> dict[str, Any]:
    """HYBRID_SHARD given no groups (LOCAL_WORLD_SIZE blocks) or a (shard, replicate) pair trains like the 2x2 mesh."""
    import os

    saved = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        default = runtime.shard(_model.make_model(), strategy=ShardingStrategy.HYBRID_SHARD, wrap=(Block,))
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = saved
    device_mesh = _helpers.mesh_for(ShardingStrategy.HYBRID_SHARD, 4)
    pair = (device_mesh.get_group(1), device_mesh.get_group(0))
    models = [runtime.shard(_model.make_model(), strategy=ShardingStrategy.HYBRID_SHARD, wrap=(Block,),
                            process_group=groups) for groups in (device_mesh, pair)]
    losses = [_model.train(m, _model.make_batches(2), rank=dist.get_rank(), world=4)[0] for m in [default, *models]]
    return {"world_sizes": {g.layout.world_size for m in [default, *models] for g in runtime.groups(m)},
            "same": losses[0] == losses[1] == losses[2]}


def _features() -> dict[str, Any]:
    return {
        "gathered": {s.name: _gathered_after(s) for s in ShardingStrategy},
        "prefetches": _prefetches(),
        "hybrid_forms": _hybrid_group_forms() if dist.get_world_size() == 4 else None,
        "clip": _clip(),
        "no_sync": {s.name: _no_sync_matches_big_batch(s) for s in ShardingStrategy},
        "summon": _summon_writeback(),
        "emulated": _emulated_collectives(),
    }


@pytest.mark.parametrize("world_size", [3, 4])
def test_clip_no_sync_summon_and_emulation(world_size: int) -> None:
    results = run_ranks(world_size, _features)
    for result in results:
        gathered = result["gathered"]
        # Root groups stay gathered from forward to backward; blocks are freed after forward under FULL_SHARD.
        assert gathered["FULL_SHARD"]["forward"] == [True, True, False, False, False, False]
        assert gathered["HYBRID_SHARD"]["forward"] == [True, True, False, False, False, False]
        assert all(gathered["SHARD_GRAD_OP"]["forward"]) and all(gathered["NO_SHARD"]["forward"])
        assert not any(any(g["backward"]) or any(g["no_grad"]) for g in gathered.values())
        # The first step records the order; the second prefetches both groups of: blocks.0 and blocks.1
        # in forward, then blocks.1 (from the root) and blocks.0 (from blocks.1) in backward.
        assert result["prefetches"] == [0, 8], result["prefetches"]
        if world_size == 4:
            assert result["hybrid_forms"] == {"world_sizes": {2}, "same": True}
        clip = result["clip"]
        torch.testing.assert_close(clip["norms"], clip["reference_norms"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(clip["losses"], clip["reference_losses"], rtol=1e-5, atol=1e-6)
        for strategy, gap in result["no_sync"].items():
            assert gap < 1e-6, (strategy, gap)
        summon = result["summon"]
        assert summon["unchanged_without_writeback"]
        assert summon["param_gap"][0] == 0.0, summon["param_gap"]
        assert summon["loss_gap"] < 1e-5
        assert result["emulated"] < 1e-6
