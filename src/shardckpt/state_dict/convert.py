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
from shardckpt.runtime.layout import FlatLayout, build_layout
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.state_dict.flat import LAYOUTS_KEY
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


def merge(states: Sequence[dict], sd_type: StateDictType) -> dict:
    """Every rank's ``{"model": ..., "optim": ...}`` of ``sd_type`` (optimizer keyed by name) -> one FULL dict.

    From LOCAL state, a param group lists its parameters in flat-group order (offline there is no
    unsharded order; names are what matter, and ``rekey_optim_state_dict`` takes the order for IDs).
    """
    if sd_type is FULL:
        return next(s for s in states if s.get("model"))
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
        out["optim"] = _merge_optim([s["optim"] for s in states], layouts)
    return out


def _merge_optim(optims: Sequence[dict], layouts: dict[str, FlatLayout]) -> dict:
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
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------------ split


def split(full: dict, sd_type: StateDictType, world_size: int, layouts: dict[str, FlatLayout]) -> list[dict]:
    """A FULL ``{"model": ..., "optim": ...}`` -> per-rank state dicts of ``sd_type`` at ``world_size``.

    ``layouts`` (flat key -> FlatLayout, e.g. ``layouts_of(local_state)``) say which entries are
    parameters and, for LOCAL, how they are flattened; their world size is re-derived.
    """
    layouts = {k: _at_world_size(v, world_size) for k, v in layouts.items()}
    return [_split_rank(full, sd_type, rank, world_size, layouts) for rank in range(world_size)]


def _at_world_size(layout: FlatLayout, world_size: int) -> FlatLayout:
    return build_layout(layout.names, layout.shapes, layout.torch_dtype, world_size,
                        requires_grad=layout.requires_grad, aliases=layout.aliases)


def _flat_of(values: dict[str, torch.Tensor], layout: FlatLayout, dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel, dtype=dtype)
    for j, name in enumerate(layout.names):
        flat[layout.offsets[j]:layout.offsets[j] + math.prod(layout.shapes[j])] = values[name].reshape(-1)
    return flat


def _flat_shard(flat: torch.Tensor, layout: FlatLayout, rank: int) -> ShardedTensor:
    start, stop = layout.shard_range(rank)
    return ShardedTensor(flat[start:stop].clone(), (layout.padded_numel,), FlatRange(start, stop))


def _split_rank(full: dict, sd_type: StateDictType, rank: int, world: int,
                layouts: dict[str, FlatLayout]) -> dict:
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
        out["model"][LAYOUTS_KEY] = {k: v.to_dict() for k, v in layouts.items()}
    if "optim" in full:
        out["optim"] = _split_optim(full["optim"], model, sd_type, rank, world, layouts)
    return out


def _split_optim(optim: dict, model: dict, sd_type: StateDictType, rank: int, world: int,
                 layouts: dict[str, FlatLayout]) -> dict:
    def sharded(name: str, value: Any) -> bool:
        return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(model[name].shape)

    if sd_type is not LOCAL:
        state = {name: {k: ShardedTensor.from_full(v, rank, world) if sd_type is SHARDED and sharded(name, v) else v
                        for k, v in entry.items()} for name, entry in optim["state"].items()}
        return {"state": state, "param_groups": [dict(pg) for pg in optim["param_groups"]]}
    state, key_of = {}, {}
    for key, layout in layouts.items():
        key_of.update({name: key for name in layout.names})
        first = optim["state"].get(layout.names[0])
        if first is None:
            continue
        entry = {}
        for k, v in first.items():
            if sharded(layout.names[0], v):
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
