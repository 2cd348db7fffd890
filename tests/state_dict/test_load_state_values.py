"""The values ``load_state`` gives besides the model's tensors and the optimizer's state: the ``extra`` entries
``save_state`` was given (tensors read whole, per-rank values each rank's own) and tensor hyper-parameters."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardckpt
from shardckpt import PerRank, StateDictType
from shardckpt.runtime import shard
from tests._dist import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), wrap=(nn.Linear,))


def _save(path: str) -> None:
    rank = dist.get_rank()
    extra = {"step": 7, "rng": PerRank(torch.tensor([rank, 10 * rank])), "loader": PerRank({"epoch": 1, "at": rank}),
             "scale": torch.arange(3.0), "nested": {"t": torch.ones(2, dtype=torch.int64), "plain": [1, "x"]}}
    model = _model()
    with torch.no_grad():  # other values than a fresh model's: a load that happened shows
        for p in model.parameters():
            p.add_(1.0)
    shardckpt.save_state(model, None, path, type=StateDictType.SHARDED_STATE_DICT, extra=extra)


def _load(path: str) -> object:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        return shardckpt.load_state(model, None, path)
    except shardckpt.CheckpointError as e:
        untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return f"{type(e).__name__}: {e}" + ("" if untouched else " (AND THE MODEL WAS LOADED IN PART)")


def test_extras_come_back_with_their_tensors_and_each_rank_its_own_per_rank_value(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(2, _save, path)
    for rank, extra in enumerate(run_ranks(2, _load, path)):
        assert extra["step"] == 7 and extra["nested"]["plain"] == [1, "x"]
        assert torch.equal(extra["rng"], torch.tensor([rank, 10 * rank])) and extra["loader"] == {"epoch": 1, "at": rank}
        assert torch.equal(extra["scale"], torch.arange(3.0))
        assert torch.equal(extra["nested"]["t"], torch.ones(2, dtype=torch.int64))


def test_a_rank_the_save_did_not_have_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(2, _save, path)
    for outcome in run_ranks(3, _load, path):
        assert isinstance(outcome, str) and outcome.startswith("IncompatibleCheckpointError")
        assert "'rng'" in outcome and "saved by 2 ranks, so rank 2 has none" in outcome
        assert "LOADED IN PART" not in outcome  # refused before any rank read anything


def test_at_a_smaller_world_size_each_rank_gets_its_own(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(2, _save, path)
    (extra,) = run_ranks(1, _load, path)
    assert torch.equal(extra["rng"], torch.tensor([0, 0])) and extra["loader"]["at"] == 0


def _tensor_lr(path: str, sharded: bool) -> float:
    torch.manual_seed(0)
    model = _model() if sharded else nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.02))
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    if sharded:
        shardckpt.save_state(model, optim, path, type=StateDictType.SHARDED_STATE_DICT)
    else:
        shardckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    fresh = _model() if sharded else nn.Linear(4, 2)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=torch.tensor(0.5))
    shardckpt.load_state(fresh, fresh_optim, path)
    lr = fresh_optim.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor), type(lr)  # it was the TensorRef placeholder, no error
    return float(lr)


def test_a_tensor_learning_rate_is_loaded_as_its_value(tmp_path):
    assert _tensor_lr(str(tmp_path / "plain"), sharded=False) == pytest.approx(0.02)
    assert run_ranks(2, _tensor_lr, str(tmp_path / "sharded"), True) == [pytest.approx(0.02)] * 2
