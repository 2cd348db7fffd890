"""Pure conversions between state-dict types and world sizes: no model, no process group.

``merge`` turns every rank's state dict (model + optimizer, name-keyed) of any type into one FULL
state dict; ``split`` turns a FULL one into per-rank state dicts of any type at any world size. Any
type converts to any other through them. LOCAL state carries its ``FlatLayout``s, which is all a
conversion needs; converting to LOCAL takes the layouts (at any world size: they are re-derived).
Everything is a region copy (``shardckpt.regions``). For checkpoints on disk, ``load_state`` does
the same without holding every rank's state in memory.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.regions import FlatRange, Region, full_region, strided_view
from shardckpt.format.flat_layout import LAYOUTS_KEY, POSITIONS, FlatLayout, param_order
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.state_dict.per_param import is_per_param, per_param_keys
from shardckpt.state_dict.rekey import keyed_by_name
from shardckpt.state_dict.types import StateDictType
from shardckpt.tensor_views import view_of

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _region_of(full: torch.Tensor, region: Region) -> torch.Tensor:
    """A view of ``region``'s elements of ``full`` (shaped as the region's local storage)."""
    return view_of(full.reshape(-1), strided_view(region, full_region(full.shape), tuple(full.shape)))


def _assemble(pieces: Sequence[Any]) -> torch.Tensor:
    """One tensor from every rank's ShardedTensor of it (replicas may repeat)."""
    first = pieces[0]
    out = torch.zeros(first.global_shape, dtype=first.dtype)
    for piece in pieces:
        _region_of(out, piece.region).copy_(piece.local.reshape(_region_of(out, piece.region).shape))
    return out


def layouts_of(local_model_state: dict) -> dict[str, FlatLayout]:
    """The flat layouts a LOCAL model state dict carries, by flat key."""
    if LAYOUTS_KEY not in local_model_state:
        raise IncompatibleCheckpointError(f"a LOCAL model state dict must carry {LAYOUTS_KEY!r}")
    return {k: FlatLayout.from_dict(v) for k, v in local_model_state[LAYOUTS_KEY].items()}


def _members(flat: torch.Tensor, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """A whole flat tensor cut back into its members, aliases included (clones: no padding kept alive)."""
    out = {}
    for j, (name, shape) in enumerate(zip(layout.names, layout.shapes)):
        value = flat[layout.offsets[j]:layout.offsets[j] + math.prod(shape)].reshape(shape).clone()
        for n in (name,) + layout.aliases[j]:
            out[n] = value
    return out


# ------------------------------------------------------------------------------------------------ merge


def merge(states: Sequence[dict], sd_type: StateDictType, optim_param_names: Sequence[str] | None = None) -> dict:
    """Every rank's ``{"model": ..., "optim": ...}`` of ``sd_type`` -> one FULL dict, optimizer keyed by name.

    ID-keyed optimizer state is read through the ``param_names`` its groups record, else through
    ``optim_param_names`` (the names of IDs 0, 1, ...; LOCAL state's IDs are its flat parameters in layout
    order), else refused. From LOCAL state, the optimizer state and each param group list the parameters in
    the unsharded ``named_parameters()`` order its layouts record (``param_order``), as the job's FULL state
    dict does; in flat-group order where they record none (older state dicts).
    """
    if sd_type is FULL:
        full = next(s for s in states if s.get("model"))
        return {**full, "optim": _by_name(full["optim"], optim_param_names, {})} if "optim" in full else full
    models = [s["model"] for s in states]
    layouts = layouts_of(models[0]) if sd_type is LOCAL else {}
    out: dict[str, Any] = {"model": {}}
    for key, value in models[0].items():
        if key == LAYOUTS_KEY:
            continue
        if not isinstance(value, ShardedTensor):
            out["model"][key] = value
        elif key in layouts:
            out["model"].update(_members(_assemble([m[key] for m in models]), layouts[key]))
        else:
            out["model"][key] = _assemble([m[key] for m in models])
    if "optim" in states[0]:
        order = param_order(models[0])
        out["optim"] = _merge_optim([_by_name(s["optim"], optim_param_names, layouts) for s in states], layouts,
                                    None if order is None else {name: i for i, name in enumerate(order)})
    return out


def _by_name(osd: dict, given: Sequence[str] | None, layouts: dict[str, FlatLayout]) -> dict:
    """Optimizer state keyed by name; LOCAL state's IDs have always meant its flat keys in layout order."""
    fallback = (lambda: dict(enumerate(layouts))) if layouts else None
    return keyed_by_name(osd, given, fallback)


def _merge_optim(optims: Sequence[dict], layouts: dict[str, FlatLayout], position: dict[str, int] | None) -> dict:
    state: dict[str, dict] = {}
    for key, entry in optims[0]["state"].items():
        merged = {k: _assemble([o["state"][key][k] for o in optims]) if isinstance(v, ShardedTensor) else v
                  for k, v in entry.items()}
        if key not in layouts:
            state[key] = merged
            continue
        layout = layouts[key]
        per_key = {k: _members(v, layout) if k in entry and isinstance(entry[k], ShardedTensor) else None
                   for k, v in merged.items()}
        for name in layout.names:
            state[name] = {k: per_key[k][name] if per_key[k] is not None else merged[k] for k in merged}
    groups = [{**pg, "params": [n for p in pg["params"] for n in (layouts[p].names if p in layouts else (p,))]}
              for pg in optims[0]["param_groups"]]
    if position is not None:  # the unsharded order, as FULL lists them (names the layouts do not place: last)
        place = lambda name: position.get(name, len(position))  # noqa: E731
        state = {name: state[name] for name in sorted(state, key=place)}
        groups = [{**pg, "params": sorted(pg["params"], key=place)} for pg in groups]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------------ split


def split(full: dict, sd_type: StateDictType, world_size: int, layouts: dict[str, FlatLayout],
          optim_param_names: Sequence[str] | None = None, param_names: Sequence[str] | None = None) -> list[dict]:
    """A FULL ``{"model": ..., "optim": ...}`` -> per-rank state dicts of ``sd_type`` at ``world_size``.

    ``layouts`` (flat key -> FlatLayout, e.g. ``layouts_of(local_state)``) say which entries are
    parameters and, for LOCAL, how they are flattened; their world size is re-derived. Optimizer state
    comes out keyed by name (ID-keyed input is read as ``merge`` reads it). ``param_names``: the unsharded
    model's ``named_parameters()`` order (``param_order(local_model_state)``), which LOCAL output's layouts
    then record (``positions``), as ``get_state_dict`` records it.
    """
    layouts = {k: v.at_world_size(world_size) for k, v in layouts.items()}
    docs = {k: v.to_dict() for k, v in layouts.items()}
    if param_names is not None:
        position = {name: i for i, name in enumerate(param_names)}
        for doc in docs.values():
            doc[POSITIONS] = [position[name] for name in doc["names"]]
    if "optim" in full:
        full = {**full, "optim": _by_name(full["optim"], optim_param_names, {})}
    return [_split_rank(full, sd_type, rank, world_size, layouts, docs) for rank in range(world_size)]


def _flat_of(values: dict[str, torch.Tensor], layout: FlatLayout, dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel, dtype=dtype)
    for j, name in enumerate(layout.names):
        flat[layout.offsets[j]:layout.offsets[j] + math.prod(layout.shapes[j])] = values[name].reshape(-1)
    return flat


def _flat_shard(flat: torch.Tensor, layout: FlatLayout, rank: int) -> ShardedTensor:
    start, stop = layout.shard_range(rank)
    return ShardedTensor(flat[start:stop].clone(), (layout.padded_numel,), FlatRange(start, stop))


def _split_rank(full: dict, sd_type: StateDictType, rank: int, world: int,
                layouts: dict[str, FlatLayout], docs: dict[str, dict]) -> dict:
    params = {n for layout in layouts.values() for j, name in enumerate(layout.names)
              for n in (name,) + layout.aliases[j]}
    model = full["model"]
    if sd_type is FULL:
        out: dict[str, Any] = {"model": dict(model)}
    elif sd_type is SHARDED:
        out = {"model": {k: ShardedTensor.from_full(v, rank, world) if k in params else v for k, v in model.items()}}
    else:
        out = {"model": {k: v for k, v in model.items() if k not in params}}
        for key, layout in layouts.items():
            out["model"][key] = _flat_shard(_flat_of(model, layout, layout.torch_dtype), layout, rank)
        out["model"][LAYOUTS_KEY] = {k: dict(doc) for k, doc in docs.items()}
    if "optim" in full:
        out["optim"] = _split_optim(full["optim"], model, sd_type, rank, world, layouts)
    return out


def _split_optim(optim: dict, model: dict, sd_type: StateDictType, rank: int, world: int,
                 layouts: dict[str, FlatLayout]) -> dict:
    keys = per_param_keys((tuple(model[name].shape), entry) for name, entry in optim["state"].items())

    def sharded(name: str, key: str, value: Any) -> bool:
        return is_per_param(key, value, tuple(model[name].shape), keys, name, strict=True)

    if sd_type is not LOCAL:
        state = {name: {k: ShardedTensor.from_full(v, rank, world) if sd_type is SHARDED and sharded(name, k, v)
                        else v for k, v in entry.items()} for name, entry in optim["state"].items()}
        return {"state": state, "param_groups": [dict(pg) for pg in optim["param_groups"]]}
    state, key_of = {}, {}
    for key, layout in layouts.items():
        key_of.update({name: key for name in layout.names})
        held = [name for name in layout.names if name in optim["state"]]
        if not held:
            continue
        if len(held) != len(layout.names):
            raise IncompatibleCheckpointError(
                f"optimizer state covers {held[:3]}... but not every member of the flat parameter {key!r}: a "
                "LOCAL optimizer state holds all of a flat parameter's members or none")
        entry = {}
        for k, v in optim["state"][layout.names[0]].items():
            if sharded(layout.names[0], k, v):
                members = {n: optim["state"][n][k] for n in layout.names}
                entry[k] = _flat_shard(_flat_of(members, layout, v.dtype), layout, rank)
            else:
                entry[k] = v
        state[key] = entry
    groups = []
    for pg in optim["param_groups"]:
        wanted = {key_of[n] for n in pg["params"] if n in key_of}
        groups.append({**pg, "params": [k for k in layouts if k in wanted]})  # in flat-group order
    return {"state": state, "param_groups": groups}
