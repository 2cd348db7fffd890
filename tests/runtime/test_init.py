"""Starting a sharded model: ``sync_module_states`` (ranks initialised differently end with rank 0's weights
and buffers, and train as rank 0's model would) and building on the ``meta`` device (materialised module by
module, each unit sharded as soon as it exists: bit for bit the model built on the CPU)."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardckpt import runtime
from shardckpt.errors import ShardingError
from tests._dist import run_ranks
from tests.runtime import _helpers, _model

STEPS = 3


def _full_state(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    state = _helpers.full_params(model, names)
    state.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return state


def _sync(strategy_name: str) -> dict:
    strategy = runtime.ShardingStrategy[strategy_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    rank0 = _model.make_model(seed=0)
    mine = _model.make_model(seed=rank)  # every rank its own initialisation
    mine.blocks[0].mask.add_(rank)  # and its own buffer values
    names = [n for n, _ in rank0.named_parameters()]
    model = runtime.shard(mine, strategy=strategy, wrap=(_model.Block,), sync_module_states=True,
                          process_group=_helpers.mesh_for(strategy, world))
    got = _full_state(model, names)
    want = {n: p.detach() for n, p in rank0.named_parameters()} | {f"buffer:{n}": b for n, b in rank0.named_buffers()}
    equal = sorted(n for n in want if torch.equal(got[n], want[n]))
    losses, _ = _model.train(model, _model.make_batches(STEPS), rank=rank, world=world)
    return {"equal": equal, "all": sorted(want), "losses": _helpers.global_mean(losses)}


@pytest.mark.parametrize("strategy, world_size", [("FULL_SHARD", 2), ("NO_SHARD", 2), ("HYBRID_SHARD", 4)])
def test_sync_module_states_gives_every_rank_rank0s_weights(strategy: str, world_size: int) -> None:
    results = run_ranks(world_size, _sync, strategy)
    reference = _helpers.reference_run(STEPS)  # unsharded, from seed 0: rank 0's model
    for r in results:
        assert r["equal"] == r["all"], sorted(set(r["all"]) - set(r["equal"]))
        torch.testing.assert_close(r["losses"], reference["losses"], rtol=2e-6, atol=0)


def _init_fn(names: dict[int, str]):
    """Materialise one module's own tensors on the CPU with values that depend only on their names."""
    def init(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        prefix = names[id(module)]
        with torch.no_grad():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if name == "mask":
                    t.copy_(torch.full_like(t, float("-inf")).triu(1))
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(f"{prefix}.{name}".encode()))
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return init


def _meta_and_cpu() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    with torch.device("meta"):
        meta = _model.TinyTransformer()
    cpu = _model.make_model()
    for model in (meta, cpu):
        init = _init_fn({id(m): n for n, m in model.named_modules()})
        if model is cpu:
            for module in cpu.modules():
                init(module)
            init(cpu.tok)  # the tied head/embedding weight holds its first owner's values, as shard ties it
    names = [n for n, _ in cpu.named_parameters()]
    no_reset = r"'<root>' \(TinyTransformer\) is on the meta device and has no reset_parameters"
    with pytest.raises(ShardingError, match=no_reset):
        with torch.device("meta"):
            runtime.shard(_model.TinyTransformer(), wrap=(_model.Block,), device="cpu")
    out = {}
    for label, model, options in (("meta", meta, {"param_init_fn": _init_fn({id(m): n for n, m in
                                                                              meta.named_modules()})}),
                                  ("cpu", cpu, {})):
        sharded = runtime.shard(model, wrap=(_model.Block,), device="cpu", **options)
        state = _full_state(sharded, names)
        losses, _ = _model.train(sharded, _model.make_batches(STEPS), rank=rank, world=world)
        out[label] = {"state": state, "losses": _helpers.global_mean(losses)}
    return {"same": sorted(n for n in out["cpu"]["state"] if torch.equal(out["cpu"]["state"][n],
                                                                         out["meta"]["state"][n])),
            "all": sorted(out["cpu"]["state"]), "losses": (out["meta"]["losses"], out["cpu"]["losses"]),
            "meta_params": sum(p.is_meta for p in sharded.parameters())}


def test_a_model_built_on_meta_shards_as_the_same_model_built_on_cpu() -> None:
    for r in run_ranks(2, _meta_and_cpu):
        assert r["same"] == r["all"], sorted(set(r["all"]) - set(r["same"]))
        meta_losses, cpu_losses = r["losses"]
        assert meta_losses == cpu_losses
        assert r["meta_params"] == 0
