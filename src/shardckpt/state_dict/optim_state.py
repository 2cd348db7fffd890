"""Optimizer state dicts of each type. With a runtime-sharded model the optimizer holds one flat shard per
group; its flat-shaped state (e.g. Adam's ``exp_avg``) converts exactly like the parameters, and its
scalars (e.g. ``step``) are replicated to every member."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardckpt.checkpoint.group import attempt, raise_failures, resolve_group
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.runtime import FlatGroup, groups, is_sharded
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.state_dict.flat import local_key, scatter_members
from shardckpt.state_dict.model_state import (
    LOCAL, SHARDED, _group_state, _set_local, local_value, member_regions, member_source, rank0_only,
)
from shardckpt.state_dict.redistribute import assemble_chunks
from shardckpt.state_dict.rekey import key_type_of, rekey_optim_state_dict
from shardckpt.state_dict.types import OptimStateKeyType, StateDictConfig, StateDictType


def param_names(model: nn.Module) -> list[str]:
    """Names of parameter IDs 0, 1, ...: the unsharded model's ``named_parameters()`` order."""
    if is_sharded(model):
        from shardckpt.runtime.state import state_of

        return list(state_of(model).param_names)
    return [name for name, _ in model.named_parameters()]


def _flat_keys(state: dict, group: FlatGroup) -> list[str]:
    """State entries shaped like the flat shard: they are sharded like the parameter itself."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == group.layout.shard_numel]


def _by_param(model: nn.Module, optim: torch.optim.Optimizer) -> list[FlatGroup]:
    """The flat group of each parameter the optimizer holds, in its order."""
    owner = {id(g.flat_param): g for g in groups(model)}
    out = []
    for pg in optim.param_groups:
        for p in pg["params"]:
            if id(p) not in owner:
                raise IncompatibleCheckpointError("the optimizer holds a parameter that is not a flat shard of this "
                                                  "sharded model: build it over model.parameters() after shard()")
            out.append(owner[id(p)])
    return out


def _member_names(group: FlatGroup, sd_type: StateDictType) -> list[str]:
    return [local_key(group)] if sd_type is LOCAL else list(group.layout.names)


def get_optim_state(model: nn.Module, optim: torch.optim.Optimizer, sd_type: StateDictType,
                    config: StateDictConfig, key_type: OptimStateKeyType) -> dict:
    init_optim_state(optim)  # so that a fresh optimizer's state dict has the structure to load into
    if not is_sharded(model):
        return _get_plain(model, optim, sd_type, key_type)
    keep = not rank0_only(config) or resolve_group().rank == 0
    flat_groups = _by_param(model, optim)
    state_out: dict[str, Any] = {}
    for group, param in zip(flat_groups, (p for pg in optim.param_groups for p in pg["params"])):
        state = optim.state.get(param, {})
        if not state:
            continue
        flat_keys = _flat_keys(state, group)
        scalars = {k: v for k, v in state.items() if k not in flat_keys}
        if sd_type is LOCAL:
            state_out[local_key(group)] = {k: local_value(group, v, config) if k in flat_keys else v
                                           for k, v in state.items()}
            continue
        rows = _group_state(group, [state[k] for k in flat_keys], sd_type, config)
        for j, name in enumerate(group.layout.names):
            if keep:
                state_out[name] = {k: rows[flat_keys.index(k)][j] if k in flat_keys else _copy(scalars[k])
                                   for k in state}
    # Parameters in the unsharded model's order, as a plain optimizer over it would list them.
    position = {name: i for i, name in enumerate(param_names(model))}
    in_order = (lambda names: names) if sd_type is LOCAL else (lambda names: sorted(names, key=position.get))
    groups_out = []
    for pg, start in zip(optim.param_groups, _starts(optim)):
        names = [name for g in flat_groups[start:start + len(pg["params"])] for name in _member_names(g, sd_type)]
        groups_out.append({**{k: v for k, v in pg.items() if k != "params"}, "params": in_order(names)})
    if not keep:
        return {}
    out = {"state": {name: state_out[name] for name in in_order(list(state_out))}, "param_groups": groups_out}
    if key_type is OptimStateKeyType.PARAM_ID:
        order = [local_key(g) for g in groups(model)] if sd_type is LOCAL else param_names(model)
        out = rekey_optim_state_dict(out, key_type, order)
    return out


def _counts(optim: torch.optim.Optimizer) -> list[int]:
    return [len(pg["params"]) for pg in optim.param_groups]


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter its optimizer state (as torch DCP does), so that it can be loaded into:
    one step on zero gradients with the learning rate set to 0, the parameters left unchanged."""
    if optim.state:
        return
    params = [p for pg in optim.param_groups for p in pg["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [pg.get("lr") for pg in optim.param_groups]
    for pg in optim.param_groups:
        if "lr" in pg:
            pg["lr"] = torch.tensor(0.0) if torch.is_tensor(pg["lr"]) else 0.0
    optim.step()
    for pg, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            pg["lr"] = lr
    with torch.no_grad():
        for p, s in zip(params, saved):  # weight decay moves parameters even at lr 0 in some optimizers
            p.copy_(s)
    optim.zero_grad(set_to_none=True)


def set_optim_state(model: nn.Module, optim: torch.optim.Optimizer, osd: dict, sd_type: StateDictType,
                    config: StateDictConfig) -> None:
    if not is_sharded(model):
        _set_plain(model, optim, osd, sd_type)
        return
    only0 = rank0_only(config)
    group0 = resolve_group()
    source = group0.rank == 0 if only0 else True
    if source and key_type_of(osd) is OptimStateKeyType.PARAM_ID:
        order = [local_key(g) for g in groups(model)] if sd_type is LOCAL else param_names(model)
        osd = rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, order)
    init_optim_state(optim)
    flat_groups = _by_param(model, optim)
    params = [p for pg in optim.param_groups for p in pg["params"]]
    # Plain parts (scalars, hyper-parameters) are small: take them from rank 0 when only it has them.
    # Checked before any data moves; with rank0_only rank 0 checks and every rank follows its verdict.
    small = attempt(group0.rank, lambda: _small_parts(osd, flat_groups, params, optim, sd_type)) if source else None
    if only0:
        small = group0.broadcast(small)
    raise_failures([small])
    scalars, hyper = small
    for group, param in zip(flat_groups, params):
        state = optim.state.get(param, {})
        flat_keys = _flat_keys(state, group)
        if sd_type is LOCAL:
            given = osd["state"].get(local_key(group), {})
            for k in flat_keys:
                _set_local(group, state[k], given.get(k), f"{local_key(group)}.{k}")
        elif flat_keys:
            rank, world = group.groups.shard_rank, group.groups.shard_size
            sources = [[member_source(osd["state"][name][k], f"{name}.{k}", group.layout.shapes[j], sd_type, rank,
                                      world) if source else None
                        for j, name in enumerate(group.layout.names)] for k in flat_keys]
            scatter_members(group, [state[k] for k in flat_keys], sources,
                            member_regions(sd_type, config, world),
                            everywhere=sd_type is StateDictType.FULL_STATE_DICT and not only0)
        for k, v in scalars.get(id(param), {}).items():
            state[k] = v.to(state[k].device) if torch.is_tensor(v) and torch.is_tensor(state.get(k)) else v
    for pg, values in zip(optim.param_groups, hyper):
        pg.update(values)


def _small_parts(osd: dict, flat_groups: list[FlatGroup], params: list, optim: torch.optim.Optimizer,
                 sd_type: StateDictType) -> tuple[dict, list]:
    """Per parameter its scalar state (from its first member), per optimizer group its hyper-parameters;
    checking that the state dict fits this optimizer."""
    scalars: dict[int, dict] = {}
    for group, param in zip(flat_groups, params):
        state = optim.state.get(param, {})
        names = _member_names(group, sd_type)
        for name in names:
            if state and name not in osd.get("state", {}):
                raise IncompatibleCheckpointError(f"optimizer state dict has no state for {name!r}")
        if state:
            given = osd["state"][names[0]]
            if set(given) != set(state):
                raise IncompatibleCheckpointError(
                    f"optimizer state for {names[0]!r} holds {sorted(given)}, this optimizer keeps {sorted(state)}: "
                    "was it saved from a different kind of optimizer?")
            flat_keys = _flat_keys(state, group)
            scalars[id(param)] = {k: _copy(v) for k, v in given.items() if k not in flat_keys}
            if sd_type is not LOCAL:  # shapes, before any data moves
                rank, world = group.groups.shard_rank, group.groups.shard_size
                for j, name in enumerate(names):
                    for k in flat_keys:
                        member_source(osd["state"][name][k], f"{name}.{k}", group.layout.shapes[j], sd_type, rank,
                                      world)
    names = [_member_names(g, sd_type) for g in flat_groups]
    return scalars, match_param_groups(osd.get("param_groups", []), optim, names)


def match_param_groups(given_groups: list[dict], optim: torch.optim.Optimizer,
                       names_of_param: list[list[str]]) -> list[dict]:
    """Hyper-parameters for each of the optimizer's param groups, from saved groups that list member names.

    ``names_of_param[i]``: the member names of the optimizer's i-th parameter. Every parameter of one
    optimizer group must sit in one saved group with the same hyper-parameter keys.
    """
    group_of = {name: i for i, pg in enumerate(given_groups) for name in pg.get("params", [])}
    hyper = []
    for pg, start in zip(optim.param_groups, _starts(optim)):
        names = [n for member_names in names_of_param[start:start + len(pg["params"])] for n in member_names]
        found = {group_of.get(n) for n in names}
        if None in found or len(found) != 1:
            raise IncompatibleCheckpointError(
                f"the saved param_groups do not match this optimizer's: parameters {names[:3]}... are "
                f"{'missing from' if None in found else 'spread over several of'} its param groups")
        given = given_groups[found.pop()]
        if set(given) - {"params"} != set(pg) - {"params"}:
            raise IncompatibleCheckpointError(f"param group hyper-parameters {sorted(set(given) - {'params'})} differ "
                                              f"from this optimizer's {sorted(set(pg) - {'params'})}: a different "
                                              "kind of optimizer?")
        hyper.append({k: v for k, v in given.items() if k != "params"})
    return hyper


def _starts(optim: torch.optim.Optimizer) -> list[int]:
    counts = _counts(optim)
    return [sum(counts[:i]) for i in range(len(counts))]


# ------------------------------------------------------------------------------------- plain models


def _plain_ids(model: nn.Module, optim: torch.optim.Optimizer) -> list[int]:
    """For each optimizer position, the parameter's ID in the model's order."""
    ids = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    return [ids[id(p)] for pg in optim.param_groups for p in pg["params"]]


def _get_plain(model: nn.Module, optim: torch.optim.Optimizer, sd_type: StateDictType,
               key_type: OptimStateKeyType) -> dict:
    osd = optim.state_dict()
    ids = _plain_ids(model, optim)
    osd = {"state": {ids[i]: dict(s) for i, s in osd["state"].items()},
           "param_groups": [{**pg, "params": [ids[i] for i in pg["params"]]} for pg in osd["param_groups"]]}
    if sd_type is SHARDED:
        g = resolve_group()
        shapes = [tuple(p.shape) for _, p in model.named_parameters()]
        for i, state in osd["state"].items():
            for k, v in state.items():
                if torch.is_tensor(v) and tuple(v.shape) == shapes[i] and v.dim() > 0:
                    state[k] = ShardedTensor.from_full(v, g.rank, g.world_size)
    return rekey_optim_state_dict(osd, key_type, param_names(model))


def _set_plain(model: nn.Module, optim: torch.optim.Optimizer, osd: dict, sd_type: StateDictType) -> None:
    osd = rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, param_names(model))
    position = {pid: i for i, pid in enumerate(_plain_ids(model, optim))}
    g = resolve_group()
    chunks = {(pid, k): v for pid, s in osd["state"].items() for k, v in s.items() if isinstance(v, ShardedTensor)}
    whole = assemble_chunks(chunks, g.rank, g.world_size, g.pg)
    state = {position[pid]: {k: whole.get((pid, k), v) for k, v in s.items()} for pid, s in osd["state"].items()}
    groups_ = [{**pg, "params": [position[pid] for pid in pg["params"]]} for pg in osd["param_groups"]]
    optim.load_state_dict({"state": state, "param_groups": groups_})
