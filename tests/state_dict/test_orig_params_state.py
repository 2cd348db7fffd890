"""State dicts of a ``use_orig_params`` run with per-parameter optimizer groups: every type, keyed either way,
resumed at another world size, loaded from and into a plain model's checkpoint, converted offline."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import IncompatibleCheckpointError, OptimStateKeyType, StateDictType
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.runtime import ShardingStrategy, shard
from tests._helpers import state_path
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block
from tests.state_dict._train import (
    STEPS_AFTER, STEPS_BEFORE, TYPES, clone_state, assert_same_state, full_state, load_each_type, steps,
)

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT
KEYS = tuple(OptimStateKeyType)


def orig_run(strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, process_group: Any = None):
    model = shard(_model.make_model(), wrap=(Block,), strategy=strategy, process_group=process_group,
                  use_orig_params=True)
    return model, torch.optim.AdamW(_model.three_lr_groups(model), lr=1e-2, weight_decay=0.1)


def _train_and_save(root: str) -> dict:
    model, optim = orig_run()
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)
    before = steps(model, optim, batches[:STEPS_BEFORE])
    for sd_type in TYPES:
        for key in KEYS:
            shardckpt.save_state(model, optim, state_path(root, sd_type, key), type=sd_type, optim_key=key)
    state = full_state(model, optim)
    after = steps(model, optim, batches[STEPS_BEFORE:])
    return {"losses": before + after, "state": state}


def _resume(root: str) -> dict:
    world = dist.get_world_size()
    results = {}
    for sd_type in TYPES:
        for key in KEYS:
            path = state_path(root, sd_type, key)
            model, optim = orig_run()
            shardckpt.load_state(model, optim, path)
            state = full_state(model, optim)
            results[("load_state", sd_type.name, key.name)] = (state, steps(model, optim, _after()))
            if sd_type is not LOCAL or world == 2:  # the in-memory route: a state dict of that type, set
                model, optim = orig_run()
                sd = shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=key)
                shardckpt.load(sd, path)
                shardckpt.set_state_dict(model, optim, sd, type=sd_type)
                results[("set_state_dict", sd_type.name, key.name)] = (full_state(model, optim),
                                                                       steps(model, optim, _after()))
    return results


def _after() -> list:
    return _model.make_batches(STEPS_BEFORE + STEPS_AFTER)[STEPS_BEFORE:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("orig"))
    return root, run_ranks(2, _train_and_save, root)[0]


@pytest.mark.parametrize("load_world", [2, 3])
def test_every_type_and_key_resumes_exactly(saved, load_world):
    root, reference = saved
    results = run_ranks(load_world, _resume, root, timeout=300)[0]
    assert len(results) == (12 if load_world == 2 else 10)
    want = reference["losses"][STEPS_BEFORE:]
    for where, (state, losses) in results.items():
        assert_same_state(state, reference["state"], f"{where} at ws {load_world}")
        if load_world == 2:
            assert losses == want, where
        else:
            assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(losses, want)), \
                (where, losses, want)
    # the per-parameter groups really are in the state: three learning rates, the gates alone in the third
    groups = reference["state"]["optim"]["param_groups"]
    assert [g["lr"] for g in groups] == [1e-2, 3e-3, 3e-2]
    assert groups[2]["params"] == ["blocks.0.gate", "blocks.1.gate"]


def _local_converts_offline(root: str, out: str, key: OptimStateKeyType) -> dict:
    """A LOCAL checkpoint saved at ws 2, converted offline to LOCAL at this world size, loads as LOCAL here into
    the state dict the job gives (keyed by ``key``: IDs numbered as the job numbers them)."""
    model, optim = orig_run()
    sd = shardckpt.get_state_dict(model, optim, type=LOCAL, optim_key=key)
    shardckpt.load(sd, out)
    shardckpt.set_state_dict(model, optim, sd, type=LOCAL)
    return full_state(model, optim)


@pytest.mark.parametrize("key", KEYS)
def test_a_local_checkpoint_converts_offline_through_its_layouts(saved, tmp_path, key):
    root, reference = saved
    src = state_path(root, LOCAL, key)
    convert(src, tmp_path / "full", type="full")
    assert diff(tmp_path / "full", state_path(root, FULL, key)).equal
    convert(src, tmp_path / "sharded4", world_size=4, type="sharded")
    assert diff(tmp_path / "sharded4", state_path(root, FULL, key)).equal
    for out_key in KEYS:  # rekeyed (name -> ID, ID -> name) or kept as it is
        out = tmp_path / f"local3-{out_key.name}"
        convert(src, out, world_size=3, type="local", optim_key=out_key)
        assert diff(out, state_path(root, LOCAL, out_key)).equal  # what the job saved keyed that way
        state = run_ranks(3, _local_converts_offline, root, str(out), out_key)[0]
        assert_same_state(state, reference["state"], f"LOCAL by {key.name} converted to ws 3 by {out_key.name}")


def _plain_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model.make_model()
    return model, torch.optim.AdamW(_model.three_lr_groups(model), lr=1e-2, weight_decay=0.1)


def _plain_steps(model, optim, batches) -> list[float]:
    losses = []
    for batch in batches:
        optim.zero_grad()
        loss = _model.loss_fn(model, *batch)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _by_name(model, optim) -> dict:
    """A plain run's model and optimizer state, the optimizer's keyed by name as get_state_dict keys it."""
    return shardckpt.get_state_dict(model, optim, type=FULL)


def _plain_into_sharded(path: str) -> dict:
    plain, plain_optim = _plain_run()
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)
    _plain_steps(plain, plain_optim, batches[:STEPS_BEFORE])
    # torch's own state dicts (IDs, no names), copied: training goes on in place
    torch_sd = clone_state({"model": plain.state_dict(), "optim": plain_optim.state_dict()})
    want = clone_state(_by_name(plain, plain_optim))
    shardckpt.save(torch_sd, path)
    expected_losses = _plain_steps(plain, plain_optim, batches[STEPS_BEFORE:])
    results = {}
    for route in ("set_state_dict", "load_state"):
        model, optim = orig_run()
        if route == "set_state_dict":
            shardckpt.set_state_dict(model, optim, torch_sd, type=FULL)
        else:
            shardckpt.load_state(model, optim, path)
        results[route] = (full_state(model, optim), steps(model, optim, batches[STEPS_BEFORE:]))
    return {"want": want, "losses": expected_losses, "results": results}


def test_a_plain_checkpoint_with_those_groups_loads_into_the_sharded_model(tmp_path):
    out = run_ranks(3, _plain_into_sharded, str(tmp_path / "plain"))[0]
    for route, (state, losses) in out["results"].items():
        assert_same_state(state, out["want"], route)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(losses, out["losses"])), route


def _sharded_into_plain(_: None) -> dict:
    model, optim = orig_run()
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)
    steps(model, optim, batches[:STEPS_BEFORE])
    by_id = clone_state(shardckpt.get_state_dict(model, optim, type=FULL, optim_key=OptimStateKeyType.PARAM_ID))
    by_name = clone_state(shardckpt.get_state_dict(model, optim, type=FULL))
    want = full_state(model, optim)
    expected = steps(model, optim, batches[STEPS_BEFORE:])
    results = {}
    for route in ("torch load_state_dict", "set_state_dict"):
        plain, plain_optim = _plain_run()
        if route == "torch load_state_dict":  # torch's own loaders, ID-keyed state as torch numbers it
            plain.load_state_dict(by_id["model"])
            plain_optim.load_state_dict(by_id["optim"])
        else:
            shardckpt.set_state_dict(plain, plain_optim, by_name, type=FULL)
        state = clone_state(_by_name(plain, plain_optim))
        results[route] = (state, _plain_steps(plain, plain_optim, batches[STEPS_BEFORE:]))
    return {"want": want, "losses": expected, "results": results}


def test_the_sharded_models_checkpoint_loads_into_a_plain_model():
    out = run_ranks(2, _sharded_into_plain, None)[0]
    for route, (state, losses) in out["results"].items():
        assert_same_state(state, out["want"], route)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(losses, out["losses"])), route


def _round_trip(strategy_name: str) -> dict:
    strategy = ShardingStrategy[strategy_name]
    mesh = _helpers.mesh_for(strategy, dist.get_world_size())
    model, optim = orig_run(strategy, mesh)
    steps(model, optim, _model.make_batches(2))
    want = full_state(model, optim)
    configs = [(FULL, None), (FULL, shardckpt.FullStateDictConfig(rank0_only=True)), (SHARDED, None), (LOCAL, None)]
    out = {}
    for sd_type, config in configs:
        for key in KEYS:
            sd = shardckpt.get_state_dict(model, optim, type=sd_type, config=config, optim_key=key)
            fresh, fresh_optim = orig_run(strategy, mesh)
            shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type, config=config)
            out[(sd_type.name, config is not None, key.name)] = full_state(fresh, fresh_optim)
    return {"want": want, "got": out}


@pytest.mark.parametrize(("strategy", "world_size"), [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 4), ("NO_SHARD", 2),
                                                      ("HYBRID_SHARD", 4)])
def test_every_type_round_trips_in_memory_for_every_strategy(strategy, world_size):
    out = run_ranks(world_size, _round_trip, strategy)[0]
    assert len(out["got"]) == 8
    for where, state in out["got"].items():
        assert_same_state(state, out["want"], f"{strategy} {where}")


def _state_on_some_ranks_only(_: None) -> str:
    model, optim = orig_run()
    steps(model, optim, _model.make_batches(1))
    if dist.get_rank() == 0:
        optim.state.pop(next(iter(optim.state)))
    with pytest.raises(IncompatibleCheckpointError, match="differs between ranks") as info:
        shardckpt.get_state_dict(model, optim, type=SHARDED)
    return str(info.value)


def test_optimizer_state_that_differs_between_ranks_is_refused_by_name():
    for message in run_ranks(2, _state_on_some_ranks_only, None):
        assert "'pos'" in message or "'tok.weight'" in message, message


class OddShapes(torch.nn.Module):
    """A 0-d parameter, an empty (0, 3) one, a one-element one and a matrix, in one unit; two groups by dimension."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.s = torch.nn.Parameter(torch.tensor(1.5))
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))
        self.one = torch.nn.Parameter(torch.tensor([0.5]))
        self.lin = torch.nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(-1) * self.s + self.one + self.empty.sum()


def _odd_run():
    model = shard(OddShapes(), use_orig_params=True)
    by_dim = [[p for p in model.parameters() if p.dim() >= 2], [p for p in model.parameters() if p.dim() < 2]]
    return model, torch.optim.AdamW([{"params": by_dim[0]}, {"params": by_dim[1], "lr": 0.1}], lr=1e-2)


def _odd_steps(model, optim, count: int) -> None:
    for seed in range(count):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
        optim.step()


def _odd_save(root: str) -> dict:
    model, optim = _odd_run()
    _odd_steps(model, optim, 2)
    for sd_type in TYPES:
        shardckpt.save_state(model, optim, f"{root}/{sd_type.name}", type=sd_type)
    want = full_state(model, optim)
    out = {}
    for sd_type in TYPES:
        sd = shardckpt.get_state_dict(model, optim, type=sd_type)
        fresh, fresh_optim = _odd_run()
        shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type)
        out[sd_type.name] = full_state(fresh, fresh_optim)
    return {"want": want, "got": out}


def _odd_load(root: str) -> dict:
    return load_each_type(_odd_run, root)


def test_zero_dim_empty_and_tiny_parameters_round_trip_and_reshard(tmp_path):
    saved = run_ranks(3, _odd_save, str(tmp_path))[0]
    assert saved["want"]["optim"]["state"]["s"]["exp_avg"].shape == ()
    assert saved["want"]["optim"]["state"]["empty"]["exp_avg"].shape == (0, 3)
    for where, state in saved["got"].items():
        assert_same_state(state, saved["want"], f"in memory {where}")
    for where, state in run_ranks(2, _odd_load, str(tmp_path))[0].items():
        assert_same_state(state, saved["want"], f"{where} saved at ws 3, loaded at ws 2")


def _permuted_groups(model, order: str) -> list[dict]:
    """The three groups, listed and filled in another order: ``reversed`` reverses both."""
    groups = _model.three_lr_groups(model)
    if order == "reversed":
        groups = [{**g, "params": list(reversed(g["params"]))} for g in reversed(groups)]
    return groups


def _permuted(root: str) -> dict:
    """Saved from an optimizer whose groups and parameters run in reverse, loaded into one in model order (and
    the reverse), by name and by ID: every parameter gets its own state and its own group's hyper-parameters."""
    out = {}
    for saved_order, load_order in (("reversed", "model"), ("model", "reversed")):
        model = shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
        optim = torch.optim.AdamW(_permuted_groups(model, saved_order), lr=1e-2, weight_decay=0.1)
        steps(model, optim, _model.make_batches(2))
        want = full_state(model, optim)
        for key in KEYS:
            path = f"{root}/{saved_order}-{key.name}"
            shardckpt.save_state(model, optim, path, type=SHARDED, optim_key=key)
            fresh = shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
            fresh_optim = torch.optim.AdamW(_permuted_groups(fresh, load_order), lr=1e-2, weight_decay=0.1)
            shardckpt.load_state(fresh, fresh_optim, path)
            got = full_state(fresh, fresh_optim)
            if got is not None:  # rank 0: group order differs, so compare per parameter and per learning rate
                lr_of = lambda sd: {n: g["lr"] for g in sd["optim"]["param_groups"] for n in g["params"]}  # noqa
                out[(saved_order, key.name)] = (
                    all(torch.equal(got["optim"]["state"][n][k], v) for n, s in want["optim"]["state"].items()
                        for k, v in s.items()) and lr_of(got) == lr_of(want),
                    sorted(g["lr"] for g in got["optim"]["param_groups"]))
    return out


def test_permuted_optimizer_orders_load_by_parameter(tmp_path):
    out = run_ranks(3, _permuted, str(tmp_path))[0]
    assert len(out) == 4
    for where, (same, lrs) in out.items():
        assert same, where
        assert lrs == [3e-3, 1e-2, 3e-2], where


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_with_nccl(tmp_path, monkeypatch):
    """On a GPU, in a NCCL world of one: bf16 compute with clipping and no_sync trains bit for bit as the flat form,
    the decay recipe as the unsharded model, and every type and key saves and resumes exactly, state on the GPU."""
    from shardckpt.runtime import MixedPrecision
    from tests.runtime.test_orig_params import train

    on_cpu = _model.make_batches
    monkeypatch.setattr(_model, "make_batches", lambda *a, **k: [(i.cuda(), t.cuda()) for i, t in on_cpu(*a, **k)])
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        params = {}
        for orig in (False, True):
            model = shard(_model.make_model().cuda(), wrap=(Block,), mixed_precision=mp, use_orig_params=orig)
            losses = train(model, "one", clip=True, accumulate=True)
            params[orig] = (losses, _helpers.full_params(model, list(dict(_model.make_model().named_parameters()))))
        assert params[True][0] == params[False][0]
        assert all(torch.equal(params[True][1][n], v) for n, v in params[False][1].items())
        reference, model = _model.make_model().cuda(), shard(_model.make_model().cuda(), wrap=(Block,),
                                                              use_orig_params=True)
        torch.testing.assert_close(train(model, "decay"), train(reference, "decay"), rtol=2e-5, atol=0)
        optim = torch.optim.AdamW(_model.three_lr_groups(model), lr=1e-2, weight_decay=0.1)
        steps(model, optim, _model.make_batches(2))
        want = full_state(model, optim)
        for sd_type in TYPES:
            for key in KEYS:
                path = state_path(str(tmp_path), sd_type, key)
                shardckpt.save_state(model, optim, path, type=sd_type, optim_key=key)
                fresh = shard(_model.make_model().cuda(), wrap=(Block,), use_orig_params=True)
                fresh_optim = torch.optim.AdamW(_model.three_lr_groups(fresh), lr=1e-2, weight_decay=0.1)
                shardckpt.load_state(fresh, fresh_optim, path)
                assert_same_state(full_state(fresh, fresh_optim), want, f"{sd_type.name} {key.name} on cuda")
                assert all(v.is_cuda for s in fresh_optim.state.values() for k, v in s.items() if k != "step")
    finally:
        dist.destroy_process_group()
