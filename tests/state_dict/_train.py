"""Training helpers run inside the ranks for the state-dict tests (model from tests/runtime/_model.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardckpt
from shardckpt import StateDictType
from shardckpt.runtime import ShardingStrategy, shard
from tests.runtime import _model
from tests.runtime._model import Block

TYPES = tuple(StateDictType)
STEPS_BEFORE, STEPS_AFTER = 3, 3


def new_run(strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, process_group: Any = None):
    model = shard(_model.make_model(), wrap=(Block,), strategy=strategy, process_group=process_group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def save_local_state(path: str) -> None:
    """A fresh run's LOCAL checkpoint (model + optimizer), collectively."""
    model, optim = new_run()
    shardckpt.save_state(model, optim, path, type=StateDictType.LOCAL_STATE_DICT)


def load_state_refused(path: str, error: type, match: str) -> str:
    """``load_state`` into a fresh run raises ``error`` matching ``match`` on this rank; its message."""
    import pytest

    model, optim = new_run()
    with pytest.raises(error, match=match) as info:
        shardckpt.load_state(model, optim, path)
    return str(info.value)


def steps(model, optim, batches) -> list[float]:
    """AdamW steps on this rank's slice of each global batch; the global mean loss of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        optim.zero_grad()
        loss = _model.loss_fn(model, *_model.local_slice(batch, rank, world))
        loss.backward()
        optim.step()
        t = loss.detach().double()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def full_state(model, optim) -> dict:
    """Model and optimizer state as full tensors keyed by name, copied (rank 0 only, None elsewhere)."""
    sd = shardckpt.get_state_dict(model, optim, type=StateDictType.FULL_STATE_DICT,
                                  config=shardckpt.FullStateDictConfig(rank0_only=True))
    return clone_state(sd) if dist.get_rank() == 0 else None


def load_each_type(new_run, root: str) -> dict[str, dict | None]:
    """Per StateDictType, a fresh ``new_run()``'s full state after ``load_state`` of ``{root}/{type name}``."""
    out = {}
    for sd_type in TYPES:
        model, optim = new_run()
        shardckpt.load_state(model, optim, f"{root}/{sd_type.name}")
        out[sd_type.name] = full_state(model, optim)
    return out


def clone_state(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    return obj


def assert_same_state(got: dict, want: dict, where: str) -> None:
    """Model and optimizer state equal bit for bit, tensor by tensor, param groups included."""
    assert got["model"].keys() == want["model"].keys(), where
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{where}: model {k}"
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys(), where
    for name, state in want["optim"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optim"]["state"][name][k], v), f"{where}: optim {name}.{k}"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"], where
