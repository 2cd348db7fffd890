"""0-d parameters (issue 19, defect 2): their per-parameter optimizer state (Adam's exp_avg) is 0-d like the
scalar ``step``, so shape alone cannot tell the two apart. A LOCAL checkpoint loaded into a plain model gave
``s`` the whole flat group's exp_avg (shape (16,)), and the next step raised."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardckpt
from shardckpt import IncompatibleCheckpointError, ShardedTensor, StateDictType
from shardckpt.runtime import shard
from shardckpt.format.flat_layout import build_layout
from shardckpt.state_dict.merge_split import split
from tests._dist import run_ranks
from tests.state_dict.test_merge_split import _equal, assert_merge_split_match_ranks

TYPES = tuple(StateDictType)
FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))


class S(nn.Module):
    """The issue's model: Linear(3, 2) and a 0-d parameter ``s``, first in ``named_parameters()`` and in its
    flat group (the offline split took a group's first member to stand for all); or, ``scalar_first=False``,
    last, as ``gain.s``."""

    def __init__(self, scalar_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        if scalar_first:
            self.s = nn.Parameter(torch.tensor(1.5))
        self.lin = nn.Linear(3, 2)
        if not scalar_first:
            self.gain = Gain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self.s if hasattr(self, "s") else self.gain.s)


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    optim.zero_grad()
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
    optim.step()


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    sd = shardckpt.get_state_dict(model, optim, type=FULL)
    return {"model": {k: v.clone() for k, v in sd["model"].items()},
            "state": {n: {k: v.clone() for k, v in s.items()} for n, s in sd["optim"]["state"].items()}}


def _train_and_save_local(path: str) -> dict:
    model = shard(S())
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for seed in range(2):
        _step(model, optim, seed)
    shardckpt.save_state(model, optim, path, type=LOCAL)
    return _full(model, optim)


def _load_into_plain(path: str) -> dict:
    model = S()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    shardckpt.load_state(model, optim, path)
    assert optim.state[model.s]["exp_avg"].shape == ()  # was (16,): the whole flat group's
    out = _full(model, optim)
    _step(model, optim, 5)  # raised "output with shape [] doesn't match the broadcast shape [16]"
    return out


def _load_into_sharded(path: str) -> dict:
    model = shard(S())
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    shardckpt.load_state(model, optim, path)
    return _full(model, optim)


def test_local_checkpoint_gives_a_0d_parameter_its_own_state(tmp_path):
    path = str(tmp_path / "local")
    want = run_ranks(2, _train_and_save_local, path)[0]
    _equal(run_ranks(1, _load_into_plain, path)[0], want, "LOCAL ws 2 -> plain")
    _equal(run_ranks(3, _load_into_sharded, path)[0], want, "LOCAL ws 2 -> ws 3")


def _every_type(scalar_first: bool) -> dict:
    model = shard(S(scalar_first))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optim, dist.get_rank())
    out = {t: shardckpt.get_state_dict(model, optim, type=t) for t in TYPES}
    plain = S(scalar_first)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=0.1)
    shardckpt.set_state_dict(plain, plain_optim, out[FULL], type=FULL)
    out["plain SHARDED"] = shardckpt.get_state_dict(plain, plain_optim, type=SHARDED)
    return out


@pytest.mark.parametrize("scalar_first", [True, False], ids=["0d-first", "0d-last"])
def test_offline_conversions_keep_0d_state_per_parameter(scalar_first):
    per_rank = run_ranks(2, _every_type, scalar_first)
    assert_merge_split_match_ranks(per_rank)
    # A plain model's SHARDED optimizer state shards 0-d per-parameter state as the runtime does; step stays plain.
    name = "s" if scalar_first else "gain.s"
    for rank in range(2):
        exp_avg, step = (per_rank[rank]["plain SHARDED"]["optim"]["state"][name][k] for k in ("exp_avg", "step"))
        assert isinstance(exp_avg, ShardedTensor) and not isinstance(step, ShardedTensor)
        _equal(exp_avg, per_rank[rank][SHARDED]["optim"]["state"][name]["exp_avg"], f"plain SHARDED rank {rank}")


def test_scalar_state_of_another_shape_is_refused(tmp_path):
    model = S()
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim, 0)
    osd = optim.state_dict()
    osd["state"][1]["step"] = torch.ones(3)  # ID 1: lin.weight
    shardckpt.save({"model": model.state_dict(), "optim": osd}, str(tmp_path / "bad"))
    fresh = S()
    with pytest.raises(IncompatibleCheckpointError, match="'step' of 'lin.weight' with shape"):
        shardckpt.load_state(fresh, torch.optim.Adam(fresh.parameters()), str(tmp_path / "bad"))
    osd["state"][1]["step"], osd["state"][0]["exp_avg"] = torch.tensor(1.0), torch.ones(3)  # ID 0: s, 0-d
    shardckpt.save({"model": model.state_dict(), "optim": osd}, str(tmp_path / "bad"), overwrite=True)
    with pytest.raises(IncompatibleCheckpointError, match="'exp_avg' of 's' with shape"):
        shardckpt.load_state(fresh, torch.optim.Adam(fresh.parameters()), str(tmp_path / "bad"))
    model_sd = {**model.state_dict(), "lin.bias": torch.zeros(1, 2)}  # same numel, another shape
    shardckpt.save({"model": model_sd}, str(tmp_path / "bad"), overwrite=True)
    with pytest.raises(IncompatibleCheckpointError, match="'lin.bias' of shape"):
        shardckpt.load_state(fresh, None, str(tmp_path / "bad"))


def test_split_refuses_when_only_0d_parameters_have_state():
    """Nothing tells a 0-d exp_avg from step then: converting to LOCAL would have to guess."""
    model = {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}
    optim = {"state": {n: {"exp_avg": torch.tensor(0.1), "step": torch.tensor(3.0)} for n in model},
             "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}
    layouts = {"_flat_param": build_layout(["a", "b"], [(), ()], torch.float32, 1)}
    with pytest.raises(IncompatibleCheckpointError, match="cannot tell"):
        split({"model": model, "optim": optim}, LOCAL, 2, layouts)
