"""Optimizer state keyed by parameter ID (issue 19, defect 1). torch numbers parameters in the order of the
optimizer's own param groups; shardckpt maps IDs through that order (or the param_names a state records, or
names the caller passes) and refuses, naming what to pass, where nothing establishes the map."""
from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import shardckpt
from shardckpt import IncompatibleCheckpointError, OptimStateKeyType, StateDictType
from shardckpt.runtime import groups, shard
from shardckpt.state_dict.merge_split import layouts_of, merge
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import new_run, steps
from tests.state_dict.test_merge_split import _equal

ID, NAME = OptimStateKeyType.PARAM_ID, OptimStateKeyType.PARAM_NAME
FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


class M(nn.Module):
    """Same-shaped parameters (a swapped state goes unnoticed by shapes), and a 0-d one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.c = nn.Parameter(torch.randn(4))
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x))) * self.s + self.c


def _train(model: nn.Module, optim: torch.optim.Optimizer, n: int = 2) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(n):
        optim.zero_grad()
        model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        optim.step()


def _build(model: M, construction: dict) -> torch.optim.Optimizer:
    """An optimizer over ``construction['groups']`` (lists of parameter names, each group its own lr)."""
    params = dict(model.named_parameters())
    pgs = [{"params": [(n, params[n]) if construction["named"] else params[n] for n in names], "lr": 0.01 * (i + 1)}
           for i, names in enumerate(construction["groups"])]
    return _optimizer(construction["kind"], pgs)


def _optimizer(kind: str, param_groups: list) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(param_groups, lr=0.1, momentum=0.9)
    return getattr(torch.optim, kind)(param_groups)


def _assert_same(optim: torch.optim.Optimizer, model: M, ref: torch.optim.Optimizer, ref_model: M) -> None:
    """Every parameter's state and group hyper-parameters, by name, bit for bit."""
    ref_params = dict(ref_model.named_parameters())
    ref_group = {id(p): pg for pg in ref.param_groups for p in pg["params"]}
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
        want = ref.state.get(ref_params[name], {})
        assert optim.state.get(p, {}).keys() == want.keys(), name
        for k, v in want.items():
            assert torch.equal(optim.state[p][k], v), f"{name}.{k}"
    for pg in optim.param_groups:
        want = ref_group[id(ref_params[next(n for n, q in model.named_parameters() if q is pg["params"][0])])]
        assert {k: v for k, v in pg.items() if k not in ("params", "param_names")} == \
            {k: v for k, v in want.items() if k not in ("params", "param_names")}


# ------------------------------------------------------------------------------------ the repros


def _saved_plain(path: str, construction: dict) -> tuple[M, torch.optim.Optimizer]:
    model = M()
    optim = _build(model, construction)
    _train(model, optim)
    shardckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, path, overwrite=True)
    return model, optim


def _torch_loaded(model: M, optim: torch.optim.Optimizer, construction: dict) -> tuple[M, torch.optim.Optimizer]:
    ref_model = M(seed=1)
    ref_model.load_state_dict(model.state_dict())
    ref = _build(ref_model, construction)
    ref.load_state_dict(optim.state_dict())
    return ref_model, ref


@pytest.mark.parametrize("construction", [
    {"groups": [["l2.weight", "l2.bias", "l1.weight", "l1.bias", "c", "s"]]},  # the order permuted
    {"groups": [["l1.weight", "l2.weight", "c", "s"], ["l1.bias", "l2.bias"]]},  # decay / no decay
], ids=["permuted", "decay-groups"])
def test_plain_optimizer_state_loads_in_its_own_order(tmp_path, construction):
    construction = {**construction, "named": False, "kind": "Adam"}
    model, optim = _saved_plain(str(tmp_path / "ckpt"), construction)
    ref_model, ref = _torch_loaded(model, optim, construction)
    loaded = M(seed=2)
    loaded_optim = _build(loaded, construction)
    shardckpt.load_state(loaded, loaded_optim, str(tmp_path / "ckpt"))
    _assert_same(loaded_optim, loaded, ref, ref_model)
    _train(loaded, loaded_optim, 1)  # and it trains on identically
    _train(ref_model, ref, 1)
    _assert_same(loaded_optim, loaded, ref, ref_model)
    # The same in memory: set_state_dict into a plain model, as torch's load_state_dict would.
    again = M(seed=2)
    again_optim = _build(again, construction)
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    shardckpt.set_state_dict(again, again_optim, sd, type=FULL)
    ref_model, ref = _torch_loaded(model, optim, construction)
    _assert_same(again_optim, again, ref, ref_model)


def test_a_sharded_model_refuses_unnamed_ids_and_takes_them_when_given(tmp_path):
    construction = {"groups": [["l2.weight", "l2.bias", "l1.weight", "l1.bias", "c", "s"]], "named": False,
                    "kind": "Adam"}
    model, optim = _saved_plain(str(tmp_path / "ckpt"), construction)
    ref_model, ref = _torch_loaded(model, optim, construction)
    sharded = shard(M(seed=2))
    sharded_optim = torch.optim.Adam(sharded.parameters())
    with pytest.raises(IncompatibleCheckpointError, match="optim_param_names"):
        shardckpt.load_state(sharded, sharded_optim, str(tmp_path / "ckpt"))
    shardckpt.load_state(sharded, sharded_optim, str(tmp_path / "ckpt"), optim_param_names=construction["groups"][0])
    _assert_same_sharded(sharded, sharded_optim, ref, ref_model)


def _assert_same_sharded(model: nn.Module, optim: torch.optim.Optimizer, ref: torch.optim.Optimizer,
                         ref_model: M) -> None:
    full = shardckpt.get_state_dict(model, optim, type=FULL)
    ref_params = dict(ref_model.named_parameters())
    for name, p in ref_params.items():
        assert torch.equal(full["model"][name], p), name
        assert full["optim"]["state"][name].keys() == ref.state[p].keys(), name
        for k, v in ref.state[p].items():
            assert torch.equal(full["optim"]["state"][name][k], v), f"{name}.{k}"


# ------------------------------------------------------------------------------------------ rekey, units


def test_rekey_reads_recorded_names_and_refuses_without_them():
    osd = {"state": {0: {"x": 1}, 1: {"x": 2}}, "param_groups": [{"lr": 1, "params": [0, 1]}]}
    with pytest.raises(IncompatibleCheckpointError, match="param_names"):
        shardckpt.rekey_optim_state_dict(osd, NAME)
    by_name = shardckpt.rekey_optim_state_dict(osd, NAME, ["b", "a"])
    assert by_name == {"state": {"b": {"x": 1}, "a": {"x": 2}}, "param_groups": [{"lr": 1, "params": ["b", "a"]}]}
    # Name -> ID numbers in param-group order, as torch does, and records the names.
    by_id = shardckpt.rekey_optim_state_dict(by_name, ID)
    assert by_id == {**osd, "param_groups": [{"lr": 1, "params": [0, 1], "param_names": ["b", "a"]}]}
    assert shardckpt.rekey_optim_state_dict(by_id, NAME) == by_name
    with pytest.raises(IncompatibleCheckpointError, match="records 'b'"):
        shardckpt.rekey_optim_state_dict(by_id, NAME, ["a", "b"])
    with pytest.raises(IncompatibleCheckpointError, match="same name"):
        shardckpt.rekey_optim_state_dict(osd, NAME, ["a", "a"])
    bad = {**by_id, "param_groups": [{"lr": 1, "params": [0, 1], "param_names": ["b"]}]}
    with pytest.raises(IncompatibleCheckpointError, match="every param"):
        shardckpt.rekey_optim_state_dict(bad, NAME)


def test_torch_named_optimizer_state_needs_no_names():
    """torch records param_names for an optimizer built over named parameters: IDs resolve by them."""
    model = M()
    optim = torch.optim.Adam([("l2.weight", model.l2.weight), ("l1.weight", model.l1.weight)])
    _train(model, optim)
    by_name = shardckpt.rekey_optim_state_dict(optim.state_dict(), NAME)
    assert list(by_name["state"]) == ["l2.weight", "l1.weight"]
    assert torch.equal(by_name["state"]["l1.weight"]["exp_avg"], optim.state[model.l1.weight]["exp_avg"])


# ------------------------------------------------------------------------------ multi-rank: get/set, merge


def _id_keyed_in_memory() -> dict:
    model, optim = new_run()
    steps(model, optim, _model.make_batches(2))
    out = {}
    for sd_type in (FULL, SHARDED, LOCAL):
        sd = shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=ID)
        name_of = {i: n for pg in sd["optim"]["param_groups"] for i, n in zip(pg["params"], pg["param_names"])}
        assert sorted(name_of) == list(range(len(name_of)))
        stripped = {**sd, "optim": {**sd["optim"], "param_groups": [
            {k: v for k, v in pg.items() if k != "param_names"} for pg in sd["optim"]["param_groups"]]}}
        fresh, fresh_optim = new_run()
        with pytest.raises(IncompatibleCheckpointError, match="optim_param_names"):
            shardckpt.set_state_dict(fresh, fresh_optim, stripped, type=sd_type)
        names = [name_of[i] for i in range(len(name_of))]
        shardckpt.set_state_dict(fresh, fresh_optim, stripped, type=sd_type, optim_param_names=names)
        _equal(shardckpt.get_state_dict(fresh, fresh_optim, type=FULL), shardckpt.get_state_dict(
            model, optim, type=FULL), f"{sd_type.name} by ID with optim_param_names")
        fresh, fresh_optim = new_run()
        shardckpt.set_state_dict(fresh, fresh_optim, sd, type=sd_type)
        _equal(shardckpt.get_state_dict(fresh, fresh_optim, type=FULL), shardckpt.get_state_dict(
            model, optim, type=FULL), f"{sd_type.name} by ID")
        out[sd_type] = (sd, shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=NAME))
    return out


def test_id_keyed_state_dicts_record_their_names_and_merge_by_them():
    per_rank = run_ranks(3, _id_keyed_in_memory)
    layouts = layouts_of(per_rank[0][LOCAL][1]["model"])
    assert layouts
    for sd_type in (FULL, SHARDED, LOCAL):
        by_id = merge([r[sd_type][0] for r in per_rank], sd_type)
        by_name = merge([r[sd_type][1] for r in per_rank], sd_type)
        _equal(by_id, by_name, f"merge({sd_type.name}) by ID")


def _save_old_style_id_checkpoint(path: str, sd_type: StateDictType) -> None:
    """What save_state(optim_key=PARAM_ID) wrote before it recorded param_names."""
    model, optim = new_run()
    steps(model, optim, _model.make_batches(2))
    sd = shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=ID)
    for pg in sd["optim"]["param_groups"]:
        del pg["param_names"]
    shardckpt.save(sd, path, metadata={"state_dict_type": sd_type.value, "optim_key": ID.value})


def _load_and_compare(path: str, name_keyed: str) -> bool:
    a, a_optim = new_run()
    shardckpt.load_state(a, a_optim, path)
    b, b_optim = new_run()
    shardckpt.load_state(b, b_optim, name_keyed)
    _equal(shardckpt.get_state_dict(a, a_optim, type=FULL), shardckpt.get_state_dict(b, b_optim, type=FULL),
           "old-style ID checkpoint")
    return True


@pytest.mark.parametrize("sd_type", [SHARDED, LOCAL])
def test_checkpoints_saved_before_names_were_recorded_still_load(tmp_path, sd_type):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run_ranks(3, _save_old_style_id_checkpoint, old, sd_type)
    run_ranks(3, _save_named, new, sd_type)
    assert all(run_ranks(2, _load_and_compare, old, new))


def _save_named(path: str, sd_type: StateDictType) -> None:
    model, optim = new_run()
    steps(model, optim, _model.make_batches(2))
    shardckpt.save_state(model, optim, path, type=sd_type)


# --------------------------------------------------------------------------------------------- property


NAMES = ["l1.weight", "l1.bias", "l2.weight", "l2.bias", "c", "s"]


UNITS = {False: [NAMES], True: [NAMES[0:2], NAMES[2:4], NAMES[4:6]]}  # flat groups without / with wrap


@st.composite
def constructions(draw) -> dict:
    """Parameter order permuted, 1-3 groups, up to two parameters in no group, plain or named, Adam or SGD.
    Half of them group whole flat groups together (no parameter left out), so that a sharded optimizer
    can be built the same way; the others mostly cannot."""
    wrap, n_groups = draw(st.booleans()), draw(st.integers(1, 3))
    if draw(st.booleans()):
        group_of = {n: draw(st.integers(0, n_groups - 1)) for unit in UNITS[wrap] for n in unit}
    else:
        group_of = {n: draw(st.integers(0, n_groups - 1)) for n in NAMES}
        for name in draw(st.lists(st.sampled_from(NAMES), max_size=2, unique=True)):
            del group_of[name]
    order = draw(st.permutations(NAMES))
    groups_ = [[n for n in order if group_of.get(n) == g] for g in range(n_groups)]
    return {"groups": [g for g in groups_ if g], "named": draw(st.booleans()),
            "kind": draw(st.sampled_from(["Adam", "AdamW", "sgd"])), "wrap": wrap}


def _sharded_construction(model: nn.Module, construction: dict) -> torch.optim.Optimizer | None:
    """The same construction for a sharded model, at flat-group granularity (None where a flat group's
    members are not all in one saved group: a flat parameter has one set of hyper-parameters)."""
    group_of = {n: i for i, names in enumerate(construction["groups"]) for n in names}
    pgs: dict[int, list] = {}
    for g in groups(model):
        found = {group_of.get(n) for n in g.layout.names}
        if len(found) != 1 or None in found:
            return None
        pgs.setdefault(found.pop(), []).append(g.flat_param)
    return _optimizer(construction["kind"], [{"params": ps, "lr": 0.01 * (i + 1)} for i, ps in sorted(pgs.items())])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(construction=constructions())
def test_any_plain_construction_loads_exactly_or_is_refused(construction):
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/ckpt"
        model, optim = _saved_plain(path, construction)
        ref_model, ref = _torch_loaded(model, optim, construction)
        loaded = M(seed=2)
        loaded_optim = _build(loaded, construction)
        shardckpt.load_state(loaded, loaded_optim, path)  # the same construction: exact, always
        _assert_same(loaded_optim, loaded, ref, ref_model)

        sharded = shard(M(seed=2), wrap=(nn.Linear,) if construction["wrap"] else None)
        sharded_optim = _sharded_construction(sharded, construction)
        names = [n for g in construction["groups"] for n in g]
        event(f"into a sharded model: {'refused' if sharded_optim is None else 'exact'}")
        if sharded_optim is None:  # the grouping does not fit the flat groups: no sharded optimizer matches it
            one_group = _optimizer(construction["kind"], [{"params": list(sharded.parameters())}])
            with pytest.raises(IncompatibleCheckpointError, match="param_groups|but none for"):
                shardckpt.load_state(sharded, one_group, path, optim_param_names=names)
            return
        if not construction["named"]:
            with pytest.raises(IncompatibleCheckpointError, match="optim_param_names"):
                shardckpt.load_state(sharded, sharded_optim, path)
        shardckpt.load_state(sharded, sharded_optim, path, optim_param_names=names)
        _assert_same_sharded(sharded, sharded_optim, ref, ref_model)
