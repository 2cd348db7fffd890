"""Optimizer state of a plain (unsharded) model, in the state-dict types' terms: keyed by name, SHARDED as dim-0
chunks of each parameter's state; loaded through torch's own ``load_state_dict``."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from shardckpt.dist.group import resolve_group
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.state_dict.param_groups import group_starts, match_param_groups
from shardckpt.format.param_ids import hyper_parameters, positional_names
from shardckpt.state_dict.per_param import is_per_param, per_param_keys
from shardckpt.state_dict.redistribute import assemble_chunks
from shardckpt.state_dict.rekey import keyed_by_name, rekey_optim_state_dict
from shardckpt.state_dict.types import OptimStateKeyType, StateDictType

SHARDED = StateDictType.SHARDED_STATE_DICT


def plain_names(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]:
    """The names of a plain model's optimizer's parameters, group by group (torch's ID order)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in name_of for pg in optim.param_groups for p in pg["params"]):
        raise IncompatibleCheckpointError("the optimizer holds a tensor that is not a parameter of this model: "
                                          "build it over the model's parameters")
    return [[name_of[id(p)] for p in pg["params"]] for pg in optim.param_groups]


def get_plain(model: nn.Module, optim: torch.optim.Optimizer, sd_type: StateDictType,
               key_type: OptimStateKeyType) -> dict:
    osd = optim.state_dict()
    names = [name for group_names in plain_names(model, optim) for name in group_names]  # torch's ID -> name
    state = {names[i]: dict(entry) for i, entry in osd["state"].items()}
    groups_ = [{**hyper_parameters(pg), "params": [names[i] for i in pg["params"]]} for pg in osd["param_groups"]]
    if sd_type is SHARDED:
        g = resolve_group()
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        keys = per_param_keys((shapes[name], entry) for name, entry in state.items())
        for name, entry in state.items():
            for k, v in entry.items():
                if is_per_param(k, v, shapes[name], keys, name, strict=False):
                    entry[k] = ShardedTensor.from_full(v, g.rank, g.world_size)
    out = {"state": state, "param_groups": groups_}
    return rekey_optim_state_dict(out, key_type, [name for name, _ in model.named_parameters()])


def check_plain(model: nn.Module, optim: torch.optim.Optimizer, osd: dict,
                 optim_param_names: Sequence[str] | None) -> tuple[dict, list[dict], dict[str, int]]:
    """By name; ID-keyed state without recorded or given names maps onto this optimizer's own param
    groups, position by position, as torch's ``load_state_dict`` does. Returns the state keyed by name, the
    hyper-parameters per group and each name's position in this optimizer."""
    live = plain_names(model, optim)
    osd = keyed_by_name(osd, optim_param_names,
                        lambda: positional_names(osd.get("param_groups", []), live, "optim_param_names"))
    names = [name for group_names in live for name in group_names]
    hyper = match_param_groups(osd["param_groups"], optim, [[name] for name in names])
    return osd, hyper, {name: i for i, name in enumerate(names)}


def set_plain(optim: torch.optim.Optimizer, osd: dict, hyper: list[dict], position: dict[str, int]) -> None:
    g = resolve_group()
    chunks = {(name, k): v for name, entry in osd["state"].items() for k, v in entry.items()
              if isinstance(v, ShardedTensor)}
    whole = assemble_chunks(chunks, g.rank, g.world_size, g.pg)
    # State for parameters this optimizer does not hold is left out, as load_state does.
    state = {position[name]: {k: whole.get((name, k), v) for k, v in entry.items()}
             for name, entry in osd["state"].items() if name in position}
    groups_ = [{**values, "params": list(range(start, start + len(pg["params"])))}
               for values, pg, start in zip(hyper, optim.param_groups, group_starts(optim))]
    optim.load_state_dict({"state": state, "param_groups": groups_})
