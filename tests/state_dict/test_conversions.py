"""State-dict types against the unsharded model, ID <-> name keys, plain-model interop, strategies, errors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import IncompatibleCheckpointError, OptimStateKeyType, ShardedTensor, StateDictType
from shardckpt.runtime import ShardingStrategy
from shardckpt.state_dict import unsharded_param_names
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import assert_same_state, full_state, new_run, steps

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT
ID, NAME = OptimStateKeyType.PARAM_ID, OptimStateKeyType.PARAM_NAME


def _plain_run(n_steps: int = 2):
    """The unsharded reference: same init, the whole global batch, one process."""
    model = _model.make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for ids, targets in _model.make_batches(n_steps):
        optim.zero_grad()
        _model.loss_fn(model, ids, targets).backward()
        optim.step()
    return model, optim


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _against_unsharded() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = new_run()
    steps(model, optim, _model.make_batches(2))
    ref_model, ref_optim = _plain_run()
    full = shardckpt.get_state_dict(model, optim, type=FULL, optim_key=ID)
    ref = ref_model.state_dict()
    assert full["model"].keys() == ref.keys()  # tied head and buffers included, as state_dict() has them
    assert all(_close(full["model"][k], v) for k, v in ref.items())
    ref_osd = ref_optim.state_dict()  # by ID: the plain torch.optim layout, plus the names of the IDs
    names = [n for n, _ in ref_model.named_parameters()]
    assert [{k: v for k, v in pg.items() if k != "param_names"} for pg in full["optim"]["param_groups"]] == \
        ref_osd["param_groups"]
    assert all(pg["param_names"] == [names[i] for i in pg["params"]] for pg in full["optim"]["param_groups"])
    assert full["optim"]["state"].keys() == ref_osd["state"].keys()
    for i, state in ref_osd["state"].items():
        assert all(_close(full["optim"]["state"][i][k], v) for k, v in state.items())
    by_name = shardckpt.get_state_dict(model, optim, type=FULL, optim_key=NAME)["optim"]
    rekeyed = shardckpt.rekey_optim_state_dict(by_name, ID, names)
    assert rekeyed["param_groups"] == full["optim"]["param_groups"]
    assert all(torch.equal(rekeyed["state"][i][k], v) for i, s in full["optim"]["state"].items() for k, v in s.items())
    sharded = shardckpt.get_state_dict(model, optim, type=SHARDED)
    for k, v in sharded["model"].items():
        want = ShardedTensor.from_full(full["model"][k], rank, world) if isinstance(v, ShardedTensor) else None
        assert want is None or (torch.equal(v.local, want.local) and v.region == want.region), k


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_types_match_the_unsharded_model(world):
    run_ranks(world, _against_unsharded)


def _save_plain(path: str) -> dict:
    model, optim = _plain_run()
    shardckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    return full_state(model, optim)


def _load_into_sharded(path: str, **kwargs) -> dict:
    model, optim = new_run()
    shardckpt.load_state(model, optim, path, **kwargs)
    return full_state(model, optim)


def _load_plain_into_sharded(path: str) -> dict:
    """A plain torch optimizer's IDs follow its own param groups: the sharded model is told the names."""
    model, optim = new_run()
    with pytest.raises(IncompatibleCheckpointError, match="optim_param_names"):
        shardckpt.load_state(model, optim, path)
    shardckpt.load_state(model, optim, path, optim_param_names=unsharded_param_names(model))
    return full_state(model, optim)


def _save_sharded(path: str, sd_type: StateDictType, strategy: ShardingStrategy, key=NAME) -> dict:
    model, optim = new_run(strategy)
    steps(model, optim, _model.make_batches(2))
    shardckpt.save_state(model, optim, path, type=sd_type, optim_key=key)
    return full_state(model, optim)


def _load_into_plain(path: str) -> dict:
    model = _model.make_model(seed=5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    shardckpt.load_state(model, optim, path)
    return full_state(model, optim)


def test_plain_state_dict_loads_into_sharded_models_and_back(tmp_path):
    plain = str(tmp_path / "plain")
    want = run_ranks(1, _save_plain, plain)[0]
    for world in (2, 3):
        assert_same_state(run_ranks(world, _load_plain_into_sharded, plain)[0], want, f"plain -> ws {world}")
    for sd_type in (FULL, SHARDED, LOCAL):
        path = str(tmp_path / sd_type.name)
        saved = run_ranks(3, _save_sharded, path, sd_type, ShardingStrategy.FULL_SHARD)[0]
        assert_same_state(run_ranks(1, _load_into_plain, path)[0], saved, f"{sd_type.name} ws 3 -> plain")


@pytest.mark.parametrize("strategy,save_world,load_world", [
    (ShardingStrategy.HYBRID_SHARD, 4, 2), (ShardingStrategy.NO_SHARD, 2, 3), (ShardingStrategy.SHARD_GRAD_OP, 3, 2)])
def test_other_strategies_save_and_reshard(tmp_path, strategy, save_world, load_world):
    for sd_type in (SHARDED, LOCAL):
        path = str(tmp_path / sd_type.name)
        saved = run_ranks(save_world, _save_sharded, path, sd_type, strategy)[0]
        assert_same_state(run_ranks(load_world, _load_into_sharded, path)[0], saved,
                          f"{strategy.name} {sd_type.name} ws {save_world} -> {load_world}")


@pytest.mark.parametrize("sd_type", [SHARDED, LOCAL])
def test_id_keyed_optimizer_state_loads_at_another_world_size(tmp_path, sd_type):
    path = str(tmp_path / sd_type.name)
    saved = run_ranks(3, _save_sharded, path, sd_type, ShardingStrategy.FULL_SHARD, ID)[0]
    assert_same_state(run_ranks(2, _load_into_sharded, path)[0], saved, f"{sd_type.name} by ID, ws 3 -> 2")


def _errors(root: str) -> list[str]:
    model, optim = new_run()
    steps(model, optim, _model.make_batches(1))
    sd = shardckpt.get_state_dict(model, optim, type=FULL)
    messages = []

    def expect(fn, *names):
        with pytest.raises(IncompatibleCheckpointError) as e:
            fn()
        assert all(n in str(e.value) for n in names), str(e.value)
        messages.append(str(e.value))

    missing = {"model": {k: v for k, v in sd["model"].items() if k != "ln_f.bias"}}
    expect(lambda: shardckpt.set_state_dict(model, None, missing, type=FULL), "ln_f.bias")
    extra = {"model": {**sd["model"], "not.a.param": torch.zeros(1)}}
    expect(lambda: shardckpt.set_state_dict(model, None, extra, type=FULL), "not.a.param")
    bad_shape = {"model": {**sd["model"], "ln_f.weight": torch.zeros(3)}}
    expect(lambda: shardckpt.set_state_dict(model, None, bad_shape, type=FULL), "ln_f.weight")
    # An optimizer of another kind: SGD with momentum keeps 'momentum_buffer', AdamW 'exp_avg'...
    sgd_model, _ = new_run()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    steps(sgd_model, sgd, _model.make_batches(1))
    shardckpt.save_state(sgd_model, sgd, f"{root}/sgd", overwrite=True)
    expect(lambda: shardckpt.load_state(model, optim, f"{root}/sgd"), "momentum_buffer")
    # Param groups that do not line up: the root and the blocks in two groups with different lr.
    params = list(model.parameters())
    two = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}], lr=1e-2)
    steps(model, two, _model.make_batches(1))
    shardckpt.save_state(model, two, f"{root}/two-groups", overwrite=True)
    expect(lambda: shardckpt.load_state(model, optim, f"{root}/two-groups"), "param_groups")
    # rank0_only: only rank 0 holds the values, yet every rank must raise (none may hang in a collective).
    rank0 = shardckpt.FullStateDictConfig(rank0_only=True)
    mine = lambda sd: sd if dist.get_rank() == 0 else {}  # noqa: E731
    expect(lambda: shardckpt.set_state_dict(model, None, mine(missing), type=FULL, config=rank0), "ln_f.bias")
    shardckpt.set_state_dict(model, optim, mine(sd), type=FULL, config=rank0)  # and a sound one loads
    bad_optim = {"model": sd["model"], "optim": {**sd["optim"], "state": {
        **sd["optim"]["state"], "ln_f.weight": {**sd["optim"]["state"]["ln_f.weight"], "exp_avg": torch.zeros(2)}}}}
    expect(lambda: shardckpt.set_state_dict(model, optim, mine(bad_optim), type=FULL, config=rank0), "ln_f.weight")
    with pytest.raises(TypeError):
        shardckpt.get_state_dict(model, optim, type=FULL, config=shardckpt.ShardedStateDictConfig())
    return messages


def test_mismatches_raise_errors_naming_the_key(tmp_path):
    messages = run_ranks(2, _errors, str(tmp_path), timeout=120)[0]
    assert len(messages) == 7
