"""get_state_dict -> set_state_dict round trips, bit-exact, for every sharding strategy x every type x rank0_only
on and off, optimizer keyed by name and by ID. NO_SHARD and HYBRID_SHARD replicate shards: with rank0_only
only global rank 0's replica can be filled from rank 0, and the other replicas must get their shards too
(issue 19, defect 3: rank 1 crashed in scatter_members, rank 0 then lost its peer, or a job hung)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import FullStateDictConfig, OptimStateKeyType, StateDictType
from shardckpt.runtime import ShardingStrategy
from shardckpt.state_dict import init_optim_state
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import new_run, steps

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT
CASES = [(FULL, FullStateDictConfig(rank0_only=False)), (FULL, FullStateDictConfig(rank0_only=True)),
         (SHARDED, None), (LOCAL, None)]
KEYS = tuple(OptimStateKeyType)
_HYBRID: dict[str, tuple] = {}


def _groups(mesh: str):
    """None (the default group), or the (shard, replicate) groups of a 2 x 2 mesh: shard within {0, 1} and
    {2, 3}, replicate across them. Made once per worker, since every rank must create every group."""
    if mesh != "2x2":
        return None
    if not _HYBRID:
        shard = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
        replicate = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
        _HYBRID["groups"] = (shard[dist.get_rank() // 2], replicate[dist.get_rank() % 2])
    return _HYBRID["groups"]


def _snapshot(model, optim) -> dict:
    """Everything, as full tensors on every rank (each rank gathers within its own replica), copied."""
    sd = shardckpt.get_state_dict(model, optim, type=FULL)
    return {"model": {k: v.clone() for k, v in sd["model"].items()},
            "state": {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for n, s in sd["optim"]["state"].items()},
            "param_groups": sd["optim"]["param_groups"]}


def _scrambled(strategy: ShardingStrategy, groups):
    """A fresh model and optimizer whose every value differs from the trained one's."""
    model, optim = new_run(strategy, groups)
    init_optim_state(optim)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-3.0)
        for b in model.buffers():
            b.fill_(5.0)
        for state in optim.state.values():
            for v in state.values():
                v.fill_(7.0)
    for pg in optim.param_groups:
        pg["lr"] = 0.5
    return model, optim


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got["model"].keys() == want["model"].keys(), where
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{where}: model {k}"
    assert got["state"].keys() == want["state"].keys(), where
    for name, state in want["state"].items():
        assert got["state"][name].keys() == state.keys(), (where, name)
        for k, v in state.items():
            assert torch.equal(got["state"][name][k], v), f"{where}: optim {name}.{k}"
    assert got["param_groups"] == want["param_groups"], where


def _round_trips(strategy_name: str, mesh: str) -> list[str]:
    strategy, groups = ShardingStrategy[strategy_name], _groups(mesh)
    model, optim = new_run(strategy, groups)
    steps(model, optim, _model.make_batches(2))
    want = _snapshot(model, optim)
    done = []
    for sd_type, config in CASES:
        for key in KEYS:
            where = f"{strategy_name} {mesh} {sd_type.name} {config} {key.name} rank {dist.get_rank()}"
            sd = shardckpt.get_state_dict(model, optim, type=sd_type, config=config, optim_key=key)
            fresh, fresh_optim = _scrambled(strategy, groups)
            shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type, config=config)
            _assert_equal(_snapshot(fresh, fresh_optim), want, where)
            done.append(where)
    return done


@pytest.mark.parametrize("strategy,world,mesh", [
    ("FULL_SHARD", 3, "default"), ("SHARD_GRAD_OP", 2, "default"), ("NO_SHARD", 2, "default"),
    ("HYBRID_SHARD", 4, "2x2"), ("HYBRID_SHARD", 4, "default")])
def test_every_type_round_trips_bit_exact(strategy, world, mesh):
    done = run_ranks(world, _round_trips, strategy, mesh, timeout=300)
    assert all(len(d) == len(CASES) * len(KEYS) for d in done)


def _given_the_other_ranks_sharded_dict() -> str:
    from torch import nn

    from shardckpt.errors import IncompatibleCheckpointError
    from shardckpt.runtime import shard

    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), wrap=(nn.Linear,))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shardckpt.get_state_dict(model, optim, type=StateDictType.SHARDED_STATE_DICT))
    other = everyone[(dist.get_rank() + 1) % dist.get_world_size()]  # per-rank files mixed up: equal-sized chunks
    for sd in (other, {"model": other["model"]}):
        try:
            shardckpt.set_state_dict(model, optim, sd, type=StateDictType.SHARDED_STATE_DICT)
            return "loaded"
        except IncompatibleCheckpointError as e:
            if "dim-0 chunk" not in str(e):
                return str(e)
    return "refused"


def test_a_sharded_dict_holding_another_ranks_chunk_is_refused():
    # helper-30: only the chunk's size was compared, so another rank's equal-sized chunk loaded in the wrong rows
    assert run_ranks(2, _given_the_other_ranks_sharded_dict, timeout=120) == ["refused", "refused"]
