"""Model state dicts of each type, for runtime-sharded models and for plain (unsharded) models."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardckpt.dist.group import attempt, raise_failures, resolve_group
from shardckpt.errors import IncompatibleCheckpointError, key_mismatch
from shardckpt.format.flat_layout import LAYOUTS_KEY, POSITIONS
from shardckpt.regions import FlatRange, canonical, dim0_chunk, full_region
from shardckpt.runtime import FlatGroup, groups, is_sharded
from shardckpt.runtime.build import FLAT_PARAM_NAMES
from shardckpt.runtime.flat_group import shards_changed
from shardckpt.runtime.state import state_of
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.state_dict.flat import (
    MemberPiece, copy_to_replicas, flat_pieces, gather_members, local_key, rank0_shard_rank, replica_source,
    scatter_members,
)
from shardckpt.state_dict.redistribute import Move, assemble_chunks, exchange
from shardckpt.state_dict.types import FullStateDictConfig, StateDictConfig, StateDictType

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _global_rank() -> int:
    return resolve_group().rank


def rank0_only(config: StateDictConfig) -> bool:
    """FULL with ``rank0_only`` (configs are checked against their type, so this implies FULL)."""
    return isinstance(config, FullStateDictConfig) and config.rank0_only


def _offload(t: torch.Tensor, config: StateDictConfig) -> torch.Tensor:
    return t.detach().cpu() if config.offload_to_cpu and t.device.type != "cpu" else t.detach()


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers under their FQNs (what ``state_dict()`` holds besides parameters)."""
    flat_names = set(FLAT_PARAM_NAMES.values())
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in nn.Module.state_dict(model, keep_vars=True).items()
            if k.rsplit(".", 1)[-1] not in flat_names and k not in params}


def member_regions(sd_type: StateDictType, config: StateDictConfig, group: FlatGroup):
    """``(shape, q) -> region``: the piece of a member that shard-group rank q has in a FULL or SHARDED state
    dict (its dim-0 chunk; or the whole member, with rank0_only only on global rank 0, so that the other
    replicas' shard groups move nothing). The same on every rank of the shard group: it is the transfer
    plan, whichever direction the data moves."""
    world = group.groups.shard_size
    if sd_type is SHARDED:
        return lambda shape, q: dim0_chunk(shape, q, world)
    if not rank0_only(config):
        return lambda shape, q: full_region(shape)
    holder = rank0_shard_rank(group.groups)
    return lambda shape, q: full_region(shape) if q == holder else None


def as_type(t: torch.Tensor, shape: tuple[int, ...], sd_type: StateDictType, rank: int, world: int) -> Any:
    """A member's gathered piece as its state-dict value: a full tensor, or a dim-0 ShardedTensor."""
    if sd_type is SHARDED:
        region = dim0_chunk(shape, rank, world)
        return ShardedTensor.dim0_chunk(t.view(_chunk_shape(shape, region)), shape, rank, world)
    return t.view(shape)


def _chunk_shape(shape: tuple[int, ...], region: FlatRange) -> tuple[int, ...]:
    if not shape:
        return () if region.numel else (0,)
    row = 1
    for s in shape[1:]:
        row *= s
    return (region.numel // row if row else 0,) + tuple(shape[1:])


# ------------------------------------------------------------------------------------------------ get


def member_values(group: FlatGroup, pieces: list[MemberPiece], sd_type: StateDictType,
                  config: StateDictConfig) -> list[Any]:
    """Each member piece's member as a FULL tensor or SHARDED chunk (None where this rank gets nothing)."""
    world, rank = group.groups.shard_size, group.groups.shard_rank
    got = gather_members(group, pieces, member_regions(sd_type, config, group))
    return [None if t is None else as_type(_offload(t, config), group.layout.shapes[j], sd_type, rank, world)
            for (j, _, _), t in zip(pieces, got)]


def local_value(group: FlatGroup, flat: torch.Tensor, config: StateDictConfig) -> ShardedTensor:
    layout, rank = group.layout, group.groups.shard_rank
    start, stop = layout.shard_range(rank)
    return ShardedTensor(_offload(flat, config), (layout.padded_numel,), FlatRange(start, stop))


def get_model_state(model: nn.Module, sd_type: StateDictType, config: StateDictConfig) -> dict[str, Any]:
    if not is_sharded(model):
        return _get_plain(model, sd_type, config)
    keep = not rank0_only(config) or _global_rank() == 0
    out: dict[str, Any] = {}
    layouts = {}
    position = {name: i for i, name in enumerate(state_of(model).param_names)}
    for group in groups(model):
        if sd_type is LOCAL:
            out[local_key(group)] = local_value(group, group.flat_param, config)
            # with each member's place in the unsharded named_parameters(), which FULL follows (formats.local_view)
            layouts[local_key(group)] = {**group.layout.to_dict(), POSITIONS: [position[n] for n in group.layout.names]}
            continue
        values = member_values(group, flat_pieces(group, group.flat_param), sd_type, config)
        for j, value in enumerate(values):
            if value is not None and keep:
                for name in (group.layout.names[j],) + group.layout.aliases[j]:
                    out[name] = value
    if keep:
        out.update({k: _offload(v, config) for k, v in buffers(model).items()})
    if sd_type is LOCAL:
        out[LAYOUTS_KEY] = layouts
    return out


def _get_plain(model: nn.Module, sd_type: StateDictType, config: StateDictConfig) -> dict[str, Any]:
    group = resolve_group()
    if rank0_only(config) and group.rank != 0:
        return {}
    sd = {k: _offload(v, config) for k, v in model.state_dict().items()}
    if sd_type is SHARDED:
        params = dict(model.named_parameters(remove_duplicate=False))
        sd = {k: ShardedTensor.from_full(v, group.rank, group.world_size) if k in params else v
              for k, v in sd.items()}
    return sd


# ------------------------------------------------------------------------------------------------ set


def _expected(model: nn.Module, sd_type: StateDictType) -> list[tuple[str, ...]]:
    """Every key the model's state dict of ``sd_type`` holds: (name, *aliases) per parameter, then buffers."""
    if sd_type is LOCAL:
        keys = [(local_key(g),) for g in groups(model)]
    else:
        keys = [(name,) + g.layout.aliases[j] for g in groups(model) for j, name in enumerate(g.layout.names)]
    return keys + [(name,) for name in buffers(model)]


def _check_state(model: nn.Module, sd: dict[str, Any], sd_type: StateDictType,
                 strict: bool) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys (strict: raise on any mismatch, shapes included); the same on every rank."""
    expected = _expected(model, sd_type)
    known = {k for names in expected for k in names} | {LAYOUTS_KEY}
    missing = [names[0] for names in expected if not any(n in sd for n in names)]
    unexpected = [k for k in sd if k not in known]
    if strict:
        check_keys(missing, unexpected, "state dict")
    for group in groups(model):
        if sd_type is LOCAL:
            if local_key(group) not in missing:
                local_source(group, sd[local_key(group)], local_key(group))
            continue
        rank, world = group.groups.shard_rank, group.groups.shard_size
        for j, name in enumerate(group.layout.names):
            member_source(_value(sd, (name,) + group.layout.aliases[j]), name, group.layout.shapes[j], sd_type,
                          rank, world)
    for name, buf in buffers(model).items():
        value = sd.get(name)
        value = value.local if isinstance(value, ShardedTensor) else value
        if value is not None and (not torch.is_tensor(value) or tuple(value.shape) != tuple(buf.shape)):
            raise IncompatibleCheckpointError(f"buffer {name!r}: the state dict holds {value!r:.80}, the model's has "
                                              f"shape {list(buf.shape)}")
    return missing, unexpected


def _value(sd: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((sd[n] for n in names if n in sd), None)


def check_keys(missing: list[str], unexpected: list[str], what: str) -> None:
    if missing or unexpected:
        raise key_mismatch(f"{what} does not match the model", missing, unexpected)


def member_source(value: Any, name: str, shape: tuple[int, ...], sd_type: StateDictType, rank: int,
                  world: int) -> torch.Tensor | None:
    """A state-dict value's local data for member ``name``, checked against what ``sd_type`` promises."""
    if value is None:
        return None
    if sd_type is SHARDED:
        want = dim0_chunk(shape, rank, world)
        # the region itself, not its size: another rank's equal-sized chunk would load in the wrong place
        if not isinstance(value, ShardedTensor) or value.global_shape != shape or \
                value.region.numel != want.numel or (want.numel and canonical(value.region, shape) != want):
            raise IncompatibleCheckpointError(
                f"{name!r}: a SHARDED state dict must hold this rank's dim-0 chunk {rank}/{world} of shape "
                f"{list(shape)}; got {value!r:.120}. Load checkpoints saved at another world size with "
                "shardckpt.load_state(), which reshards from files.")
        return value.local.reshape(-1)
    t = value.local if isinstance(value, ShardedTensor) else value
    if tuple(t.shape) != tuple(shape):
        raise IncompatibleCheckpointError(f"{name!r}: shape {list(t.shape)} does not match the model's {list(shape)}")
    return t.reshape(-1)


def set_model_state(model: nn.Module, sd: dict[str, Any], sd_type: StateDictType, config: StateDictConfig,
                    strict: bool = True) -> tuple[list[str], list[str]]:
    """Load ``sd`` of type ``sd_type`` into the model; returns (missing, unexpected) keys when not strict.

    Everything is checked before any data moves, so that all ranks raise together or none does.
    """
    if not is_sharded(model):
        return _set_plain(model, sd, sd_type, config, strict)
    state_of(model).check_not_summoned("loading a state dict")
    shards_changed()  # groups kept gathered must not serve the weights from before the load
    only0 = rank0_only(config)
    world_group = resolve_group()
    if only0:  # only rank 0 holds the values: it checks, and every rank follows its verdict
        verdict = attempt(0, lambda: _check_state(model, sd, sd_type, strict)) if world_group.rank == 0 else None
        verdict = world_group.broadcast(verdict)
        raise_failures([verdict])
        missing, unexpected = verdict
    else:  # every rank checks its own; a failure on one is raised on all, before any exchange could wait for it
        verdicts = world_group.all_gather(attempt(world_group.rank, lambda: _check_state(model, sd, sd_type, strict)))
        raise_failures(verdicts)
        missing, unexpected = verdicts[world_group.rank]
        other = next((r for r, v in enumerate(verdicts) if v[0] != verdicts[0][0]), None)
        if other is not None:  # the same verdict on every rank: all raise
            raise IncompatibleCheckpointError(
                f"the state dicts given differ between ranks in the entries they leave out (rank 0 misses "
                f"{verdicts[0][0][:5]}, rank {other} {verdicts[other][0][:5]}): a state dict given on rank 0 only "
                "loads with FullStateDictConfig(rank0_only=True)")
    source = world_group.rank == 0 if only0 else True
    replicas: dict[int, int] = {}  # id(Groups) -> the replica that holds global rank 0 (rank0_only)
    for group in groups(model):
        if sd_type is LOCAL:
            if local_key(group) not in missing:
                _set_local(group, group.flat_param, sd[local_key(group)], local_key(group))
            continue
        layout, rank, world = group.layout, group.groups.shard_rank, group.groups.shard_size
        pieces = [piece for piece in flat_pieces(group, group.flat_param) if layout.names[piece[0]] not in missing]
        srcs = [member_source(_value(sd, (layout.names[j],) + layout.aliases[j]), layout.names[j], layout.shapes[j],
                              sd_type, rank, world) if source else None for j, _, _ in pieces]
        scatter_members(group, pieces, srcs, member_regions(sd_type, config, group),
                        everywhere=sd_type is FULL and not only0)
        if only0:
            fill_replicas(group, [group.flat_param], replicas)
    bufs = buffers(model)
    if only0:
        _broadcast_buffers(bufs, sd)
    else:
        _set_buffers(bufs, sd)
    return missing, unexpected


def fill_replicas(group: FlatGroup, flat_tensors: list[torch.Tensor], sources: dict[int, int]) -> None:
    """After a rank0_only scatter, which filled global rank 0's replica only: copy its shards to the
    others. ``sources`` caches each Groups' source replica for the call (finding it is a collective)."""
    key = id(group.groups)
    if key not in sources:
        sources[key] = replica_source(group.groups)
    copy_to_replicas(group, flat_tensors, sources[key])


def _set_local(group: FlatGroup, flat: torch.Tensor, value: Any, key: str) -> None:
    with torch.no_grad():
        flat.copy_(local_source(group, value, key))


def local_source(group: FlatGroup, value: Any, key: str) -> torch.Tensor:
    """A LOCAL state-dict value's data for this rank's flat shard of ``group``, checked to be that shard."""
    layout, rank = group.layout, group.groups.shard_rank
    start, stop = layout.shard_range(rank)
    if value is None:
        raise IncompatibleCheckpointError(f"LOCAL state dict has no {key!r}")
    if not isinstance(value, ShardedTensor) or value.global_shape != (layout.padded_numel,) or \
            value.region != FlatRange(start, stop):
        raise IncompatibleCheckpointError(
            f"{key!r}: this LOCAL state was made with another world size or wrapping (it holds "
            f"{getattr(value, 'region', None)} of {getattr(value, 'global_shape', None)}, this rank holds "
            f"{FlatRange(start, stop)} of ({layout.padded_numel},)); use shardckpt.load_state() to reshard it")
    return value.local


def _broadcast_buffers(bufs: dict[str, torch.Tensor], sd: dict[str, Any]) -> None:
    """rank0_only: rank 0's values for every buffer, on every rank (rank 0 holds, everyone wants)."""
    group = resolve_group()
    have = group.broadcast(sorted(k for k in bufs if k in sd) if group.rank == 0 else None)
    moves = []
    for name in have:
        buf = bufs[name]
        src = sd[name].to(device=buf.device, dtype=buf.dtype) if group.rank == 0 else None
        region = full_region(buf.shape)
        moves.append(Move(tuple(buf.shape), [region] + [None] * (group.world_size - 1),
                          [region] * group.world_size, src, buf.detach()))
    exchange(moves, group.rank, group.world_size, group.pg)


def _set_buffers(bufs: dict[str, torch.Tensor], sd: dict[str, Any]) -> None:
    with torch.no_grad():
        for name, buf in bufs.items():
            if name in sd:
                value = sd[name]
                buf.copy_(value.local if isinstance(value, ShardedTensor) else value)


def _set_plain(model: nn.Module, sd: dict[str, Any], sd_type: StateDictType, config: StateDictConfig,
               strict: bool) -> tuple[list[str], list[str]]:
    group = resolve_group()
    if rank0_only(config) and group.world_size > 1:
        raise IncompatibleCheckpointError("FULL rank0_only loading needs a sharded model (a plain model holds "
                                          "the full weights on every rank; load them on every rank)")
    chunks = {k: v for k, v in sd.items() if isinstance(v, ShardedTensor)}
    full = {**sd, **assemble_chunks(chunks, group.rank, group.world_size, group.pg)}
    result = model.load_state_dict(full, strict=strict)
    return list(result.missing_keys), list(result.unexpected_keys)
