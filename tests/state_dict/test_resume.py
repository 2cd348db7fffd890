"""Train, save as every type, load at every world size by every route, continue: the run must not notice."""
from __future__ import annotations

import math

import pytest
import torch.distributed as dist

import shardckpt
from shardckpt import StateDictType
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import (
    STEPS_AFTER, STEPS_BEFORE, TYPES, assert_same_state, full_state, new_run, steps,
)

WORLD_SIZES = (1, 2, 3, 4)
FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _path(root: str, world: int, sd_type: StateDictType) -> str:
    return f"{root}/ws{world}-{sd_type.name}"


def _train_and_save(root: str) -> dict:
    world = dist.get_world_size()
    model, optim = new_run()
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)
    before = steps(model, optim, batches[:STEPS_BEFORE])
    for sd_type in TYPES:
        shardckpt.save_state(model, optim, _path(root, world, sd_type), type=sd_type, extra={"step": STEPS_BEFORE})
    state = full_state(model, optim)
    after = steps(model, optim, batches[STEPS_BEFORE:])
    return {"losses": before + after, "state": state}


def _resume(model, optim) -> tuple[dict, list[float]]:
    state = full_state(model, optim)
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)[STEPS_BEFORE:]
    return state, steps(model, optim, batches)


def _load_every_way(root: str, saved_world: int) -> dict:
    """Every (route, saved type) this world size can load; each continues training from the checkpoint."""
    world = dist.get_world_size()
    results = {}
    for saved in TYPES:
        path = _path(root, saved_world, saved)
        model, optim = new_run()
        extra = shardckpt.load_state(model, optim, path)
        assert extra == {"step": STEPS_BEFORE}
        results[("load_state", saved.name)] = _resume(model, optim)
        # The in-memory route: a state dict of the load type, filled by shardckpt.load, then set.
        for load_type in TYPES:
            names_match = saved is not LOCAL and load_type is not LOCAL
            if not (names_match or (saved is LOCAL and load_type is LOCAL and world == saved_world)):
                continue
            model, optim = new_run()
            sd = shardckpt.get_state_dict(model, optim, type=load_type)
            shardckpt.load(sd, path, strict=False)
            shardckpt.set_state_dict(model, optim, sd, type=load_type)
            results[(f"load as {load_type.name}", saved.name)] = _resume(model, optim)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    return root, {w: run_ranks(w, _train_and_save, root)[0] for w in WORLD_SIZES}


@pytest.mark.parametrize("load_world", WORLD_SIZES)
@pytest.mark.parametrize("save_world", WORLD_SIZES)
def test_resume_from_every_type_at_every_world_size(saved, save_world, load_world):
    root, runs = saved
    reference = runs[save_world]
    results = run_ranks(load_world, _load_every_way, root, save_world, timeout=300)[0]
    assert len(results) >= 3 + 4  # every saved type by load_state, FULL/SHARDED by the in-memory route
    for (route, saved_type), (state, losses) in results.items():
        where = f"{saved_type} saved at ws {save_world}, {route} at ws {load_world}"
        assert_same_state(state, reference["state"], where)
        want = reference["losses"][STEPS_BEFORE:]
        if load_world == save_world:
            assert losses == want, where  # bit-exact: the interruption changes nothing
        else:
            assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(losses, want)), \
                (where, losses, want)


@pytest.mark.parametrize("key", ["model", "optim"])
def test_extra_may_not_name_the_saved_state(tmp_path, key):
    # helper-30: extra={"model": ...} replaced the model's state in the checkpoint, and the save succeeded
    import torch
    from torch import nn

    from shardckpt.errors import BadArgumentError

    model = nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(BadArgumentError, match=key):
        shardckpt.save_state(model, optim, str(tmp_path / "ckpt"), extra={key: 1, "step": 3})
    assert not (tmp_path / "ckpt").exists()
    shardckpt.save_state(model, optim, str(tmp_path / "ckpt"), extra={"step": 3})
    assert shardckpt.load_state(model, optim, str(tmp_path / "ckpt")) == {"step": 3}


def test_a_load_after_a_backward_loads_the_optimizer_state_and_keeps_the_gradients(tmp_path):
    # helper-30: a fresh optimizer whose parameters had gradients got no state to load into: the load left it empty
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    shardckpt.save_state(model, optim, str(tmp_path / "ckpt"))
    fresh = nn.Linear(4, 2)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh(torch.randn(5, 4)).sum().backward()
    grads = [p.grad.clone() for p in fresh.parameters()]
    shardckpt.load_state(fresh, fresh_optim, str(tmp_path / "ckpt"))
    for p, q, grad in zip(model.parameters(), fresh.parameters(), grads):
        assert torch.equal(p, q) and torch.equal(q.grad, grad)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optim.state[p][key], fresh_optim.state[q][key]), key


def test_a_resume_into_groups_split_with_other_hyper_parameters_is_refused(tmp_path):
    # helper-30: a checkpoint of one group loaded into decay / no-decay groups gave both the saved weight_decay
    import torch
    from torch import nn

    from shardckpt.errors import IncompatibleCheckpointError

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    shardckpt.save_state(model, optim, str(tmp_path / "ckpt"))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    split = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.1)
    with pytest.raises(IncompatibleCheckpointError, match="different hyper-parameters"):
        shardckpt.load_state(model, split, str(tmp_path / "ckpt"))
    same = torch.optim.AdamW([{"params": decay}, {"params": rest}], lr=0.1, weight_decay=0.05)
    shardckpt.load_state(model, same, str(tmp_path / "ckpt"))  # a split that changes nothing loads
    assert [g["weight_decay"] for g in same.param_groups] == [0.05, 0.05]


def test_a_parameter_the_saved_groups_lack_is_named(tmp_path):
    # helper-30 (minor): the message listed the group's first parameters, present ones included
    import torch
    from torch import nn

    from shardckpt.errors import IncompatibleCheckpointError

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    shardckpt.save_state(model, torch.optim.Adam(model[0].parameters()), str(tmp_path / "ckpt"))
    with pytest.raises(IncompatibleCheckpointError, match=r"\['1.weight', '1.bias'\]... are missing"):
        shardckpt.load_state(model, torch.optim.Adam(model.parameters()), str(tmp_path / "ckpt"))


def test_an_init_step_that_raises_leaves_learning_rates_and_gradients_as_they_were(tmp_path):
    # helper-31: LBFGS wants a closure: the zero-lr init step raised and left lr 0 and zeroed gradients behind
    import torch
    from torch import nn

    model = nn.Linear(4, 2)
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5)
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError):
        shardckpt.save_state(model, optim, str(tmp_path / "ckpt"))
    assert optim.param_groups[0]["lr"] == 0.5
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values))
