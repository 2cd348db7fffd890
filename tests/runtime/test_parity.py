"""Sharded training matches unsharded training and torch's own FSDP2, for every strategy and world size."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardckpt import runtime
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block

STEPS = 5


def _parity(strategy_name: str) -> dict[str, Any]:
    strategy = runtime.ShardingStrategy[strategy_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _helpers.reference_run(STEPS)
    model = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,),
                          process_group=_helpers.mesh_for(strategy, world))
    losses, _ = _model.train(model, _model.make_batches(STEPS), rank=rank, world=world)
    ours = {"losses": _helpers.global_mean(losses), "params": _helpers.full_params(model, list(reference["params"]))}
    fsdp2 = _helpers.torch_fsdp2_run(strategy, STEPS)
    return {
        "reference_losses": reference["losses"], "losses": ours["losses"], "fsdp2_losses": fsdp2["losses"],
        "vs_reference": _helpers.max_param_diff(ours["params"], reference["params"]),
        "vs_fsdp2": _helpers.max_param_diff(ours["params"], fsdp2["params"]),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", [s.name for s in runtime.ShardingStrategy])
def test_training_matches_unsharded_and_fsdp2(strategy: str, world_size: int) -> None:
    results = run_ranks(world_size, _parity, strategy)
    for rank, result in enumerate(results):
        print(rank, result)
        assert result == results[0], "ranks disagree"
    result = results[0]
    if world_size == 1:
        assert result["losses"] == result["reference_losses"]
        assert result["vs_reference"][0] == 0.0, result["vs_reference"]
    # Otherwise only the summation order of the gradient average differs: a few ulp after 5 steps.
    torch.testing.assert_close(result["losses"], result["reference_losses"], rtol=2e-6, atol=0)
    torch.testing.assert_close(result["losses"], result["fsdp2_losses"], rtol=2e-6, atol=0)
    assert result["vs_reference"][0] < 2e-6, result["vs_reference"]
    assert result["vs_fsdp2"][0] < 2e-6, result["vs_fsdp2"]
