"""Optimizer state that must not pair wrong data: parameters saved without state, state one flat shard cannot hold,
optimizers or state dicts that differ between ranks, empty param groups. Each loads exactly or is refused on
every rank (no rank left waiting), naming the parameter."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import IncompatibleCheckpointError, StateDictType
from shardckpt.runtime import shard
from tests._dist import run_ranks
from tests.runtime import _model
from tests.runtime._model import Block
from tests.state_dict._train import TYPES, assert_same_state, full_state, load_each_type, steps

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _run(orig: bool = True, groups=_model.three_lr_groups):
    model = shard(_model.make_model(), wrap=(Block,), use_orig_params=orig)
    return model, torch.optim.AdamW(groups(model) if orig else model.parameters(), lr=1e-2, weight_decay=0.1)


def _refused(fn, match: str) -> str:
    with pytest.raises(IncompatibleCheckpointError, match=match) as info:
        fn()
    return str(info.value)


def _stateless(root: str) -> dict[str, Any]:
    """The embedding frozen after shard (a warm-up recipe): AdamW keeps no state for it."""
    model, optim = _run()
    model.tok.weight.requires_grad_(False)
    steps(model, optim, _model.make_batches(2))
    want = full_state(model, optim)
    out: dict[str, Any] = {"want": want, "in_memory": {}}
    for sd_type in TYPES:
        sd = shardckpt.get_state_dict(model, optim, type=sd_type)
        fresh, fresh_optim = _run()
        shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type)
        out["in_memory"][sd_type.name] = full_state(fresh, fresh_optim)
        shardckpt.save_state(model, optim, f"{root}/{sd_type.name}", type=sd_type)
    flat, flat_optim = _run(orig=False)  # the root's flat shard holds tok.weight beside ln_f: one state for all
    out["into_flat"] = _refused(lambda: shardckpt.load_state(flat, flat_optim, f"{root}/{FULL.name}"),
                                "but none for")
    return out


def _stateless_load(root: str) -> dict[str, Any]:
    return load_each_type(_run, root)


def test_a_parameter_without_optimizer_state_loads_without_it(tmp_path):
    saved = run_ranks(2, _stateless, str(tmp_path))[0]
    assert "tok.weight" not in saved["want"]["optim"]["state"] and "ln_f.weight" in saved["want"]["optim"]["state"]
    for where, state in saved["in_memory"].items():
        assert_same_state(state, saved["want"], f"in memory {where}")
    for where, state in run_ranks(3, _stateless_load, str(tmp_path))[0].items():
        assert_same_state(state, saved["want"], f"load_state {where} at ws 3")
    assert "'tok.weight'" in saved["into_flat"] and "use_orig_params=True" in saved["into_flat"]


def _steps_differ(root: str) -> dict[str, str]:
    """The gates skip the first step (their .grad set to None), so their `step` is one behind: a flat shard that
    holds them with other members has one `step` for all, and must refuse rather than pick one."""
    model, optim = _run(groups=lambda m: [{"params": list(m.parameters())}])
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, batch in enumerate(_model.make_batches(3)):
        optim.zero_grad()
        _model.loss_fn(model, *_model.local_slice(batch, rank, world)).backward()
        for name, p in model.named_parameters():
            if name.endswith("gate") and i == 0:
                p.grad = None
        optim.step()
    out = {}
    for sd_type in (FULL, SHARDED):
        sd = shardckpt.get_state_dict(model, optim, type=sd_type)
        flat, flat_optim = _run(orig=False)
        out[f"set {sd_type.name}"] = _refused(lambda: shardckpt.set_state_dict(flat, flat_optim, sd, type=sd_type),
                                              "differs from that of")
    for sd_type in TYPES:
        shardckpt.save_state(model, optim, f"{root}/{sd_type.name}", type=sd_type)
        flat, flat_optim = _run(orig=False)
        out[f"load_state {sd_type.name}"] = _refused(
            lambda: shardckpt.load_state(flat, flat_optim, f"{root}/{sd_type.name}"), "differs from that of")
    return out


def test_scalars_that_differ_between_members_of_one_flat_shard_are_refused(tmp_path):
    for result in run_ranks(2, _steps_differ, str(tmp_path)):
        assert len(result) == 5
        for where, message in result.items():
            assert "'step'" in message and "gate" in message, (where, message)


class _RankScalar(torch.optim.SGD):
    """SGD that also keeps the norm of the gradient this rank sees: a scalar state that differs between ranks."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["seen_norm"] = p.grad.norm()


def _differ_between_ranks(_: None) -> dict[str, list[str]]:
    rank = dist.get_rank()
    batches = _model.make_batches(1)
    out: dict[str, list[str]] = {}
    # an optimizer that leaves out the empty pieces (ranks that own none of a gate): other parameters per rank
    model = shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad and p.numel() > 0], lr=1e-2)
    steps(model, optim, batches)
    out["pieces left out"] = [_refused(lambda: shardckpt.get_state_dict(model, optim, type=t), "differ between ranks")
                              for t in TYPES]
    model, optim = _run()
    scalar = _RankScalar(model.parameters(), lr=1e-2)
    steps(model, scalar, batches)
    out["scalar per rank"] = [_refused(lambda: shardckpt.get_state_dict(model, scalar, type=t), "'seen_norm'")
                              for t in TYPES]
    # a state dict given on rank 0 only, without rank0_only: refused on every rank (the others would wait)
    for orig in (False, True):
        model, optim = _run(orig)
        steps(model, optim, batches)
        sd = shardckpt.get_state_dict(model, optim, type=FULL)
        fresh, fresh_optim = _run(orig)
        given = sd if rank == 0 else {}
        out[f"rank 0 only, orig={orig}"] = [_refused(
            lambda: shardckpt.set_state_dict(fresh, fresh_optim, given, type=FULL), "rank")]
        broken = sd if rank == 0 else {"model": sd["model"], "optim": {**sd["optim"], "state": {}}}
        out[f"no optimizer state on rank 0 only, orig={orig}"] = [_refused(
            lambda: shardckpt.set_state_dict(fresh, fresh_optim, sd if rank else {"model": sd["model"]}, type=FULL),
            r"optimizer state on ranks \[1, 2\] only")]
        out[f"optimizer state on rank 0 only, orig={orig}"] = [_refused(
            lambda: shardckpt.set_state_dict(fresh, fresh_optim, broken, type=FULL), "rank")]
    return out


def test_what_differs_between_ranks_is_refused_on_every_rank():
    results = run_ranks(3, _differ_between_ranks, None)
    for rank, result in enumerate(results):
        assert len(result) == 8, result
        for message in result["pieces left out"]:
            assert "only on rank 0" in message and "gate" in message, message
        for message in result["scalar per rank"]:
            assert "differs between ranks" in message, message
        for orig in (False, True):
            assert "rank0_only=True" in result[f"rank 0 only, orig={orig}"][0] or \
                "state dict does not match" in result[f"rank 0 only, orig={orig}"][0], result
            assert "differ between ranks" in result[f"optimizer state on rank 0 only, orig={orig}"][0], result


def _empty_group(root: str) -> dict[str, Any]:
    """A recipe's group that came out empty (no embeddings in this model, say) saves and loads like the others."""
    def groups(model):
        decay, no_decay = _model.decay_groups(model)
        return [decay, {"params": [], "lr": 0.5}, no_decay]

    model, optim = _run(groups=groups)
    steps(model, optim, _model.make_batches(2))
    want = full_state(model, optim)
    out = {}
    for sd_type in TYPES:
        sd = shardckpt.get_state_dict(model, optim, type=sd_type)
        fresh, fresh_optim = _run(groups=groups)
        fresh_optim.param_groups[1]["lr"] = 0.25
        shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type)
        out[f"set {sd_type.name}"] = (full_state(fresh, fresh_optim), fresh_optim.param_groups[1]["lr"])
        shardckpt.save_state(model, optim, f"{root}/{sd_type.name}", type=sd_type)
        fresh, fresh_optim = _run(groups=groups)
        fresh_optim.param_groups[1]["lr"] = 0.25
        shardckpt.load_state(fresh, fresh_optim, f"{root}/{sd_type.name}")
        out[f"load_state {sd_type.name}"] = (full_state(fresh, fresh_optim), fresh_optim.param_groups[1]["lr"])
    return {"want": want, "got": out}


def test_an_empty_param_group_round_trips(tmp_path):
    result = run_ranks(2, _empty_group, str(tmp_path))[0]
    assert len(result["got"]) == 6
    for where, (state, lr) in result["got"].items():
        assert_same_state(state, result["want"], where)
        assert lr == 0.5, where


def _untouched(_: None) -> dict[str, Any]:
    """A state dict refused by set_state_dict leaves model and optimizer as they were: every check runs first."""
    model, optim = _run()
    steps(model, optim, _model.make_batches(2))
    out = {}
    for sd_type in TYPES:
        sd = shardckpt.get_state_dict(model, optim, type=sd_type)
        bad_optim = {**sd, "optim": {**sd["optim"], "param_groups": [
            {k: v for k, v in pg.items() if k != "amsgrad"} for pg in sd["optim"]["param_groups"]]}}
        model_keys = list(sd["model"])
        bad_model = {**sd, "model": {**sd["model"], model_keys[-2]: sd["model"][model_keys[0]]}}  # a late key wrong
        for what, bad in (("optim", bad_optim), ("model", bad_model)):
            fresh, fresh_optim = _run()
            steps(fresh, fresh_optim, _model.make_batches(1, seed=5))
            before = full_state(fresh, fresh_optim)
            out[(sd_type.name, what)] = (_refused(lambda: shardckpt.set_state_dict(fresh, fresh_optim, bad,
                                                                                   type=sd_type), ""),
                                         before, full_state(fresh, fresh_optim))
    flat, flat_optim = _run(orig=False)
    sd = shardckpt.get_state_dict(model, optim, type=LOCAL)
    out["other form"] = _refused(lambda: shardckpt.set_state_dict(flat, flat_optim, sd, type=LOCAL), "load_state")
    return out


def test_a_refused_state_dict_changes_nothing():
    result = run_ranks(2, _untouched, None)[0]
    assert "use_orig_params=True" in result.pop("other form")
    assert len(result) == 6
    for where, (message, before, after) in result.items():
        assert message, where
        assert_same_state(after, before, f"{where}: {message}")
