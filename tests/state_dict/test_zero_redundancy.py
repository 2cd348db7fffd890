"""torch's ``ZeroRedundancyOptimizer`` (optimizer state partitioned over ranks, parameters replicated), in both
forms: its consolidated ``state_dict()`` (a plain ID-keyed optimizer state in the model's parameter order, no
names recorded: ``optim_param_names`` says them), and each rank's own partition saved with
``zero_partition_state`` (nothing gathered). Either resumes into a runtime-sharded model at another world size
through ``load_state``, continuing the loss curve; the partition form equals the consolidated state bit for bit,
converts, and loads back into a ``ZeroRedundancyOptimizer`` at another world size (issue 15)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import shardckpt
from shardckpt import runtime
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.dist.group import LOCAL
from shardckpt.state_dict.zero_redundancy import load_zero_partition_state, zero_partition_state
from tests._dist import run_ranks
from tests.runtime import _helpers, _model

BEFORE, AFTER = 2, 3
NAMES = [n for n, _ in _model.make_model().named_parameters()]  # ZeRO's IDs: the model's parameter order


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


def _zero(model) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _train_with_zero(consolidated: str, partitioned: str) -> list[float]:
    """Train, save both forms, go on (the uninterrupted run); rank 0 also checks that the forms agree."""
    model = _model.make_model()
    opt = _zero(model)
    batches = _model.make_batches(BEFORE + AFTER)
    _zero_steps(model, opt, batches[:BEFORE])
    shardckpt.save({"model": model.state_dict(), "optim": zero_partition_state(opt, NAMES)}, partitioned)
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        whole = opt.state_dict()
        shardckpt.save({"model": model.state_dict(), "optim": whole}, consolidated, process_group=LOCAL)
        read = shardckpt.load_full(partitioned)["optim"]
        assert read["zero_partition"] == {"world_size": 2, "owners": [opt._param_to_rank[p] for p in
                                                                      model.parameters()]}
        assert set(read["zero_partition"]["owners"]) == {0, 1}  # both ranks own (and wrote) a part
        assert set(read["state"]) == set(whole["state"])
        for i, entry in whole["state"].items():
            for key, value in entry.items():
                assert torch.equal(read["state"][i][key], value), (i, key)
        for saved, expected in zip(read["param_groups"], whole["param_groups"]):
            assert saved == {**expected, "param_names": [NAMES[i] for i in expected["params"]]}
    dist.barrier()
    return _zero_steps(model, opt, batches[BEFORE:])


def _resume_sharded(path: str, names: list[str] | None) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = runtime.shard(_model.make_model(seed=9), wrap=(_model.Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    shardckpt.load_state(model, optim, path, optim_param_names=names)
    losses = []
    for batch in _model.make_batches(BEFORE + AFTER)[BEFORE:]:
        optim.zero_grad()
        loss = _model.loss_fn(model, *_model.local_slice(batch, rank, world))
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return _helpers.global_mean(losses)


def _resume_zero(path: str) -> list[float]:
    model = _model.make_model(seed=9)
    full = shardckpt.load_full(path, ["model"])["model"]
    model.load_state_dict(full)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.5, weight_decay=0.5)
    load_zero_partition_state(opt, path)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.optim.param_groups[0]["weight_decay"] == 0.1
    return _zero_steps(model, opt, _model.make_batches(BEFORE + AFTER)[BEFORE:])


def _close(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    consolidated, partitioned = str(root / "consolidated"), str(root / "partitioned")
    uninterrupted = run_ranks(2, _train_with_zero, consolidated, partitioned)[0]
    return consolidated, partitioned, uninterrupted


def test_a_consolidated_zero_redundancy_checkpoint_resumes_in_the_runtime_at_another_world_size(saved):
    consolidated, _, uninterrupted = saved
    resumed = run_ranks(3, _resume_sharded, consolidated, NAMES)[0]
    assert _close(resumed, uninterrupted), (resumed, uninterrupted)


def test_a_partitioned_save_resumes_in_the_runtime_without_being_told_the_names(saved):
    _, partitioned, uninterrupted = saved
    resumed = run_ranks(3, _resume_sharded, partitioned, None)[0]
    assert _close(resumed, uninterrupted), (resumed, uninterrupted)


def test_a_partitioned_save_loads_back_into_zero_at_another_world_size(saved):
    _, partitioned, uninterrupted = saved
    resumed = run_ranks(3, _resume_zero, partitioned)[0]
    assert _close(resumed, uninterrupted), (resumed, uninterrupted)


def test_a_partitioned_save_converts_and_equals_the_consolidated_one(saved, tmp_path):
    consolidated, partitioned, _ = saved
    convert(partitioned, tmp_path / "full", world_size=1)
    assert diff(partitioned, tmp_path / "full").equal
    converted, whole = shardckpt.load_full(tmp_path / "full"), shardckpt.load_full(consolidated)
    assert converted["model"].keys() == whole["model"].keys()
    assert all(torch.equal(converted["model"][k], t) for k, t in whole["model"].items())
    assert converted["optim"]["state"].keys() == whole["optim"]["state"].keys()
    for i, entry in whole["optim"]["state"].items():
        assert all(torch.equal(converted["optim"]["state"][i][k], t) for k, t in entry.items()), i
