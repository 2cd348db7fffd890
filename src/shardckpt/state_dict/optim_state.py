"""Optimizer state dicts of each type. With a runtime-sharded model the optimizer holds one flat shard per
group; its flat-shaped state (e.g. Adam's ``exp_avg``) converts exactly like the parameters, and its
scalars (e.g. ``step``) are replicated to every member."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn

from shardckpt.dist.group import Failure, agreed, attempt, raise_failures, resolve_group
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.runtime import FlatGroup, groups, is_sharded
from shardckpt.runtime.state import state_of
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.regions import FlatRange
from shardckpt.state_dict.flat import Held, held_params, held_region, local_key, scatter_members
from shardckpt.state_dict.model_state import (
    LOCAL, _offload, fill_replicas, local_source, local_value, member_regions, member_source, member_values,
    rank0_only,
)
from shardckpt.state_dict.optim_checks import (
    agree, check_members_agree, check_same_optimizer, fingerprint, same_value,
)
from shardckpt.state_dict.param_groups import group_starts, match_param_groups
from shardckpt.format.param_ids import hyper_parameters, positional_names
from shardckpt.state_dict.per_param import shaped_like
from shardckpt.state_dict.plain_optim import check_plain, get_plain, set_plain
from shardckpt.state_dict.rekey import keyed_by_name, rekey_optim_state_dict
from shardckpt.state_dict.types import OptimStateKeyType, StateDictConfig, StateDictType


def unsharded_param_names(model: nn.Module) -> list[str]:
    """The unsharded model's ``named_parameters()`` names, in order (of a sharded model too): the names of
    IDs 0, 1, ... of a plain optimizer built over the unsharded model's ``parameters()`` in one group, and
    of the IDs ``get_state_dict(optim_key=PARAM_ID)`` gives (which also records them as ``param_names``)."""
    if is_sharded(model):
        return list(state_of(model).param_names)
    return [name for name, _ in model.named_parameters()]


def _per_member_keys(state: dict, held: Held) -> list[str]:
    """State entries shaped like the parameter (a flat shard, or a member's piece): sharded like it."""
    return [k for k, v in state.items() if shaped_like(v, tuple(held.param.shape))]


def _held(model: nn.Module, optim: torch.optim.Optimizer) -> list[Held]:
    """What each parameter the optimizer holds is, in its order."""
    owner = held_params(groups(model))
    out = []
    for pg in optim.param_groups:
        for p in pg["params"]:
            if id(p) not in owner:
                raise IncompatibleCheckpointError(
                    "the optimizer holds a parameter that is not a parameter of this sharded model: build it over "
                    "model.parameters() (or named_parameters()) after shard()")
            out.append(owner[id(p)])
    if len({h.whole_shard for h in out}) > 1:
        raise IncompatibleCheckpointError("the optimizer holds both flat shards and original parameters of the "
                                          "sharded model: build it over model.parameters() after shard()")
    return out


def names_by_group(helds: list[Held], optim: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the names of an optimizer's original parameters (``use_orig_params``), in its order."""
    return [[h.names[0] for h in helds[start:start + len(pg["params"])]]
            for pg, start in zip(optim.param_groups, group_starts(optim))]


def _state_names(held: Held, sd_type: StateDictType) -> list[str]:
    """How a state dict of ``sd_type`` names the optimizer state of ``held``: its members, or LOCAL's flat key."""
    return [local_key(held.group)] if sd_type is LOCAL and held.whole_shard else held.names


def _held_everywhere(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[list[Held], list[dict]]:
    """What the optimizer holds (``_held``) and its state per parameter, checked to be alike on every rank
    (collective; see ``optim_checks``)."""
    found: dict[str, Any] = {}

    def look() -> tuple[list[list[str]], list[tuple]]:
        found["helds"] = helds = _held(model, optim)
        found["states"] = states = [optim.state.get(p, {}) for pg in optim.param_groups for p in pg["params"]]
        entries = []
        for h, state in zip(helds, states):
            keys = _per_member_keys(state, h)
            entries.append((sorted(map(str, state)), sorted(map(str, keys)),
                            {str(k): fingerprint(v) for k, v in state.items() if k not in keys}))
        return names_by_group(helds, optim), entries

    _, everyone = agree(resolve_group(), look)
    if everyone is not None:
        check_same_optimizer(everyone)
    return found["helds"], found["states"]


def get_optim_state(model: nn.Module, optim: torch.optim.Optimizer, sd_type: StateDictType,
                    config: StateDictConfig, key_type: OptimStateKeyType) -> dict:
    init_optim_state(optim)  # so that a fresh optimizer's state dict has the structure to load into
    keep = not rank0_only(config) or resolve_group().rank == 0
    if not is_sharded(model):
        return get_plain(model, optim, sd_type, key_type) if keep else {}
    helds, states = _held_everywhere(model, optim)
    flat = all(h.whole_shard for h in helds)
    state_out: dict[str, Any] = {}
    if sd_type is LOCAL:
        for held, state in zip(helds, states):
            if state:
                keys = _per_member_keys(state, held)
                state_out[_state_names(held, LOCAL)[0]] = {
                    k: _local_state(held, v, config) if k in keys else v for k, v in state.items()}
    else:
        for group in groups(model):
            mine = [(h, state) for h, state in zip(helds, states) if h.group is group and state]
            _gather_group_state(group, mine, sd_type, config, state_out if keep else {})
    # Parameters in the unsharded model's order, as a plain optimizer over it would list them.
    position = {name: i for i, name in enumerate(unsharded_param_names(model))}
    flat_keys = sd_type is LOCAL and flat
    in_order = (lambda names: names) if flat_keys else (lambda names: sorted(names, key=position.get))
    groups_out = []
    for pg, start in zip(optim.param_groups, group_starts(optim)):
        names = [name for h in helds[start:start + len(pg["params"])] for name in _state_names(h, sd_type)]
        groups_out.append({**hyper_parameters(pg), "params": in_order(names)})
    if not keep:
        return {}
    out = {"state": {name: state_out[name] for name in in_order(list(state_out))}, "param_groups": groups_out}
    if key_type is OptimStateKeyType.PARAM_ID:
        order = [local_key(g) for g in groups(model)] if flat_keys else unsharded_param_names(model)
        out = rekey_optim_state_dict(out, key_type, order)  # records the names: self-describing
    return out


def _gather_group_state(group: FlatGroup, mine: list[tuple[Held, dict]], sd_type: StateDictType,
                        config: StateDictConfig, out: dict[str, Any]) -> None:
    """The FULL or SHARDED state of every member of ``group`` the optimizer holds, by member name, into ``out``
    (one exchange for the group): per-member entries gathered, scalars copied from the parameter's own state
    (a flat shard's are every member's)."""
    pieces, where = [], []
    for held, state in mine:
        for k in _per_member_keys(state, held):
            for piece in held.pieces(state[k]):
                pieces.append(piece)
                where.append((k, piece[0]))
    values = dict(zip(where, member_values(group, pieces, sd_type, config))) if pieces else {}
    for held, state in mine:
        for j in held.members:
            out[group.layout.names[j]] = {k: values[(k, j)] if (k, j) in values else _copy(v) for k, v in state.items()}


def _local_state(held: Held, value: torch.Tensor, config: StateDictConfig) -> ShardedTensor:
    """LOCAL optimizer state as held: a flat shard's (see ``local_value``), or a member's piece as the flat range of
    the member it is (empty where the rank holds none): per-parameter state that reshards by name."""
    if held.whole_shard:
        return local_value(held.group, value, config)
    (j,) = held.members
    layout = held.group.layout
    region = held_region(layout, j, held.group.groups.shard_rank) or FlatRange(0, 0)
    return ShardedTensor(_offload(value, config).reshape(-1), layout.shapes[j], region)


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter its optimizer state (as torch DCP does), so that it can be loaded into:
    one step on zero gradients with the learning rate set to 0, the parameters left unchanged."""
    if optim.state:
        return
    params = [p for pg in optim.param_groups for p in pg["params"] if p.requires_grad]
    grads = [p.grad for p in params]  # a backward before the load keeps its gradients (torch's load does too)
    saved = [p.detach().clone() for p in params]
    lrs = [pg.get("lr") for pg in optim.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for pg in optim.param_groups:
            if "lr" in pg:
                pg["lr"] = torch.tensor(0.0) if torch.is_tensor(pg["lr"]) else 0.0
        optim.step()
    finally:  # also when the step raises (LBFGS wants a closure): learning rates, parameters and gradients as given
        for pg, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                pg["lr"] = lr
        with torch.no_grad():
            for p, s in zip(params, saved):  # weight decay moves parameters even at lr 0 in some optimizers
                p.copy_(s)
        for p, grad in zip(params, grads):
            p.grad = grad


def prepare_optim_state(model: nn.Module, optim: torch.optim.Optimizer, osd: dict, sd_type: StateDictType,
                        config: StateDictConfig, optim_param_names: Sequence[str] | None = None,
                        ) -> Callable[[], None]:
    """Check that ``osd`` loads into ``optim`` (collective: on every rank, or on none), and return what loads it;
    nothing moves before. ``set_state_dict`` checks the optimizer state before the model state moves."""
    if not is_sharded(model):
        group = resolve_group()
        checked = agreed(group, lambda: check_plain(model, optim, osd, optim_param_names))
        return functools.partial(set_plain, optim, *checked)
    only0 = rank0_only(config)
    group0 = resolve_group()
    source = group0.rank == 0 if only0 else True
    init_optim_state(optim)
    helds, states = _held_everywhere(model, optim)
    params = [p for pg in optim.param_groups for p in pg["params"]]
    orig = not all(h.whole_shard for h in helds)
    named: dict[str, dict] = {"osd": {}}

    def check() -> tuple[dict, list, list[int]]:
        # Original parameters have an order of their own, as a plain optimizer's do; flat shards have none.
        fallback = (lambda: positional_names(osd.get("param_groups", []), names_by_group(helds, optim),
                                             "optim_param_names")) if orig else None
        named["osd"] = keyed_by_name(osd, optim_param_names, fallback)
        return _small_parts(named["osd"], helds, states, optim, sd_type)

    # Plain parts (scalars, hyper-parameters) are small: take them from rank 0 when only it has them.
    # Checked before any data moves; with rank0_only rank 0 checks and every rank follows its verdict.
    small = attempt(group0.rank, check) if source else None
    if only0:
        small = group0.broadcast(small)
        raise_failures([small])
    else:
        _agree_on_verdicts(small, helds)
    scalars, hyper, stateless = small
    for i in stateless:  # saved without state (no gradient yet): loaded as torch loads it, without
        states[i] = {}

    def apply() -> None:
        osd, replicas = named["osd"], {}
        if sd_type is LOCAL:
            for held, state in zip(helds, states):
                (key,) = _state_names(held, LOCAL)
                given = osd["state"].get(key, {})
                for k in _per_member_keys(state, held):
                    with torch.no_grad():
                        state[k].view(-1).copy_(_local_state_source(held, given.get(k), f"{key}.{k}").reshape(-1))
        else:
            for group in groups(model):
                mine = [(h, state) for h, state in zip(helds, states) if h.group is group and state]
                _scatter_group_state(group, mine, osd if source else None, sd_type, config, only0, replicas)
        for i, state in enumerate(states):
            for k, v in scalars.get(i, {}).items():
                state[k] = v.to(state[k].device) if torch.is_tensor(v) and torch.is_tensor(state.get(k)) else v
        for pg, values in zip(optim.param_groups, hyper):
            pg.update(values)
        for i in stateless:
            optim.state.pop(params[i], None)

    return apply


def _agree_on_verdicts(small: Any, helds: list[Held]) -> None:
    """Raise on every rank if the check failed on any, or if ranks disagree on which parameters are saved without
    state (collective): either would leave the other ranks waiting in, or pairing wrong pieces in, the exchanges."""
    verdicts = resolve_group().all_gather(small if isinstance(small, Failure) else small[2])
    raise_failures(verdicts)
    other = next((r for r, v in enumerate(verdicts) if v != verdicts[0]), None)
    if other is not None:
        names = [helds[i].names[0] for i in sorted(set(verdicts[0]) ^ set(verdicts[other]))]
        raise IncompatibleCheckpointError(
            f"the optimizer state dicts given differ between ranks: rank 0's and rank {other}'s disagree on "
            f"whether {names[:5]} have state: give every rank the state dict saved (a state dict given on rank "
            "0 only loads with FullStateDictConfig(rank0_only=True))")


def _scatter_group_state(group: FlatGroup, mine: list[tuple[Held, dict]], osd: dict | None, sd_type: StateDictType,
                         config: StateDictConfig, only0: bool, replicas: dict[int, int]) -> None:
    """Fill the per-member optimizer state of ``group``'s parameters from a FULL or SHARDED ``osd`` keyed by name
    (None on ranks that hold none of it: rank0_only), in one exchange."""
    rank, world = group.groups.shard_rank, group.groups.shard_size
    pieces, sources, targets = [], [], []
    for held, state in mine:
        for k in _per_member_keys(state, held):
            targets.append(state[k])
            for piece in held.pieces(state[k]):
                j = piece[0]
                name = group.layout.names[j]
                pieces.append(piece)
                sources.append(None if osd is None else member_source(
                    osd["state"][name][k], f"{name}.{k}", group.layout.shapes[j], sd_type, rank, world))
    if not pieces:
        return
    scatter_members(group, pieces, sources, member_regions(sd_type, config, group),
                    everywhere=sd_type is StateDictType.FULL_STATE_DICT and not only0)
    if only0:
        fill_replicas(group, targets, replicas)


def _local_state_source(held: Held, value: Any, key: str) -> torch.Tensor:
    """LOCAL optimizer state's data for ``held`` (a flat shard's, or a member's piece as ``_local_state`` gives it),
    checked to be what this rank holds."""
    if held.whole_shard:
        return local_source(held.group, value, key)
    (j,) = held.members
    layout = held.group.layout
    want = held_region(layout, j, held.group.groups.shard_rank) or FlatRange(0, 0)
    if not isinstance(value, ShardedTensor) or value.global_shape != layout.shapes[j] or \
            value.region.numel != want.numel or (want.numel and value.region != want):
        raise IncompatibleCheckpointError(
            f"{key!r}: this LOCAL state was made with another world size or wrapping (it holds "
            f"{getattr(value, 'region', None)} of {getattr(value, 'global_shape', None)}, this rank holds {want} "
            f"of {layout.shapes[j]}); use shardckpt.load_state() to reshard it")
    return value.local


def _small_parts(osd: dict, helds: list[Held], states: list[dict], optim: torch.optim.Optimizer,
                 sd_type: StateDictType) -> tuple[dict, list, list[int]]:
    """Per parameter (by position: they travel to other ranks) its scalar state, per optimizer group its
    hyper-parameters, and the positions of parameters the state dict keeps no state for (the optimizer that saved
    it had none: no gradient yet); checking that the state dict fits this optimizer."""
    scalars: dict[int, dict] = {}
    stateless = []
    saved = osd.get("state", {})
    for i, (held, state) in enumerate(zip(helds, states)):
        if not state:
            continue
        names = _state_names(held, sd_type)
        keys = _per_member_keys(state, held)
        if not check_members_agree(names, [saved.get(name) for name in names], same_value, keys.__contains__):
            stateless.append(i)
            continue
        given = saved[names[0]]
        if set(given) != set(state):
            raise IncompatibleCheckpointError(
                f"optimizer state for {names[0]!r} holds {sorted(given)}, this optimizer keeps {sorted(state)}: "
                "was it saved from a different kind of optimizer?")
        scalars[i] = {k: _copy(v) for k, v in given.items() if k not in keys}
        group = held.group  # shapes and regions, before any data moves
        rank, world = group.groups.shard_rank, group.groups.shard_size
        for j, name in zip(held.members, names):
            for k in keys:
                if sd_type is LOCAL:
                    _local_state_source(held, saved[name][k], f"{name}.{k}")
                else:
                    member_source(saved[name][k], f"{name}.{k}", group.layout.shapes[j], sd_type, rank, world)
    hyper = match_param_groups(osd.get("param_groups", []), optim, [_state_names(h, sd_type) for h in helds])
    return scalars, hyper, stateless
