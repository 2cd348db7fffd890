"""torch's ``ZeroRedundancyOptimizer`` saved and loaded partition by partition, never gathered on one rank.

``zero_partition_state(optimizer)`` is this rank's part of the optimizer's state as a state dict that every rank
passes to ``shardckpt.save`` (collective): the checkpoint it makes is the very optimizer state that
``consolidate_state_dict()`` + ``state_dict()`` would give (keyed by ZeRO's parameter IDs, param groups as
ZeRO's), each parameter's state written by the rank that owns it. So ``load_state`` (into a runtime-sharded model
at any world size), ``convert``, ``diff`` and ``load_full`` read it as any optimizer state.

How the partition is recorded: every state tensor is saved as a ``ShardedTensor`` that its owner holds whole and
every other rank holds empty (a zero-element region), so its owner writes it and the manifest's chunks say so;
and ``zero_partition``, next to ``state`` and ``param_groups``, says it in plain terms: ``{"world_size": W,
"owners": [rank owning ID 0, ID 1, ...]}``. ``param_names`` (the names of IDs 0, 1, ...) go into the param groups
(``param_names``, torch's own convention), so that the checkpoint loads by name without being told them.

``load_zero_partition_state(optimizer, path)`` loads such a checkpoint (or any ID-keyed optimizer state of the
same parameters: a consolidated one) into a ``ZeroRedundancyOptimizer`` at any world size, each rank reading
only the state of the parameters it owns now.

ZeRO's own partition (which rank owns which parameter) is private to it: ``_param_to_rank`` and
``_param_to_index`` are read here, as torch's ``state_dict``/``load_state_dict`` use them.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from shardckpt.checkpoint.load import load_full
from shardckpt.dist.group import resolve_group
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.dtypes import DTYPES, dtype_name
from shardckpt.regions import Box, FlatRange
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.storage_options import Options

PARTITION_KEY = "zero_partition"


def zero_partition_state(optimizer: Any, param_names: Sequence[str] | None = None) -> dict:
    """This rank's part of ``optimizer``'s (a ``ZeroRedundancyOptimizer``) state, for ``shardckpt.save`` from
    every rank (collective: one small all-gather of what each rank's state holds). ``param_names``:
    the names of the parameters in ZeRO's order (its param groups', e.g. the model's ``named_parameters()``)."""
    params = _ordered_params(optimizer)
    if param_names is not None and len(param_names) != len(params):
        raise ValueError(f"param_names names {len(param_names)} parameters; the optimizer has {len(params)}")
    owners = [optimizer._param_to_rank[p] for p in params]  # ZeRO's partition (private to it)
    rank = optimizer.rank
    mine = {i: _describe(optimizer.optim.state.get(p, {})) for i, p in enumerate(params) if owners[i] == rank}
    described: dict[int, dict] = {}
    ranks = resolve_group(optimizer.process_group)
    for part in ranks.all_gather(mine):
        described.update(part)
    state = {}
    for i, p in enumerate(params):
        local = optimizer.optim.state.get(p, {}) if owners[i] == rank else {}
        entry = {key: _sharded(local.get(key), spec) if spec[0] == "tensor" else spec[1]
                 for key, spec in described.get(i, {}).items()}
        if entry:
            state[i] = entry
    groups, first = [], 0
    for group in optimizer.param_groups:
        ids = list(range(first, first + len(group["params"])))
        first += len(ids)
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = ids
        if param_names is not None:
            saved["param_names"] = [param_names[i] for i in ids]
        groups.append(saved)
    return {"state": state, "param_groups": groups, PARTITION_KEY: {"world_size": ranks.world_size, "owners": owners}}


def load_zero_partition_state(optimizer: Any, path: str | os.PathLike, *, key: str = "optim",
                              storage_options: Options | None = None) -> None:
    """Load the ID-keyed optimizer state at ``key`` of the checkpoint at ``path`` into ``optimizer`` (a
    ``ZeroRedundancyOptimizer`` of the same parameters, at any world size): each rank reads the param groups and
    the state of the parameters it owns, nothing else. Not collective."""
    params = _ordered_params(optimizer)
    owned = [i for i, p in enumerate(params) if optimizer._param_to_rank[p] == optimizer.rank]
    wanted = [f"{key}.param_groups"] + [f"{key}.state.{i}" for i in owned]
    saved = load_full(path, wanted, storage_options=storage_options).get(key, {})
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != \
            [len(g["params"]) for g in optimizer.param_groups]:
        raise IncompatibleCheckpointError(f"{path}: the saved param groups ({key}.param_groups) do not hold this "
                                          "optimizer's parameters group for group")
    if any(g["params"] != list(range(sum(len(h["params"]) for h in groups[:n]), sum(len(h["params"])
                                                                                    for h in groups[:n + 1])))
           for n, g in enumerate(groups)):
        raise IncompatibleCheckpointError(f"{path}: the saved optimizer state is not keyed by ZeRO's parameter IDs "
                                          "0, 1, ... in group order (convert it with --optim-key id)")
    state = saved.get("state", {})
    optimizer.load_state_dict({"state": {i: state[i] for i in owned if i in state}, "param_groups": groups})


def _ordered_params(optimizer: Any) -> list[torch.Tensor]:
    """The parameters in ZeRO's ID order (its param groups', one after the other)."""
    index = optimizer._param_to_index
    return sorted(index, key=index.__getitem__)


def _describe(state: dict) -> dict[str, tuple]:
    """What a parameter's state holds, as every rank must know it to save its part: tensors by dtype and shape,
    other values as they are."""
    return {k: ("tensor", dtype_name(v.dtype, k), tuple(v.shape)) if torch.is_tensor(v) else ("value", v)
            for k, v in state.items()}


def _sharded(value: torch.Tensor | None, spec: tuple) -> ShardedTensor:
    """The owner's tensor whole, or (``value`` None: another rank owns it) an empty piece of its shape."""
    _, dtype, shape = spec
    if value is not None:
        return ShardedTensor(value.detach(), shape, Box((0,) * len(shape), shape))
    return ShardedTensor(torch.empty(0, dtype=DTYPES[dtype]), shape, FlatRange(0, 0))
