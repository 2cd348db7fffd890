"""Building the flat groups unit by unit, from a model on a real device or on the ``meta`` device.

A module whose own parameters or buffers are on ``meta`` is materialised when ``named_modules()`` reaches
it (the order eager construction initialises in): by ``param_init_fn(module)``, or by
``module.to_empty(device, recurse=False)`` and its ``reset_parameters()``. A unit is flattened and sharded
as soon as every module owning one of its members exists, and its full parameters are dropped then, so a
model larger than one rank's memory can be sharded: the peak is the units not yet complete (the root's
own parameters, which span the model, and the unit under construction), not the model. Tied parameters
materialised once per owner are tied again to the first owner's tensor, as a model ties them after init.

``sync_module_states``: each unit's parameters are broadcast from rank 0 before it is sharded (over the
shard group, then the replicate group: every rank ends with global rank 0's values), and every buffer
once all units are built, so that ranks may start from different initialisations.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch
from torch import nn

from shardckpt.dist import collectives
from shardckpt.errors import ShardingError
from shardckpt.runtime.flat_group import FlatGroup, Member
from shardckpt.runtime.process_groups import Groups

InitFn = Callable[[nn.Module], None]


def _on_meta(module: nn.Module) -> bool:
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in own)


def materialize(name: str, module: nn.Module, device: torch.device, param_init_fn: InitFn | None) -> None:
    """Give ``module``'s own meta parameters and buffers storage on ``device`` and their initial values."""
    if param_init_fn is not None:
        param_init_fn(module)
    else:
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ShardingError(f"module {name or '<root>'!r} ({type(module).__name__}) is on the meta device and "
                                "has no reset_parameters() to initialise it; pass shard(..., param_init_fn=fn), "
                                "fn(module) materialising and initialising one module's own tensors")
        module.to_empty(device=device, recurse=False)
        reset()
    if _on_meta(module):
        raise ShardingError(f"module {name or '<root>'!r} ({type(module).__name__}) is still on the meta device "
                            "after its initialisation: param_init_fn must materialise its own parameters and "
                            "buffers (module.to_empty(device=..., recurse=False), then set their values)")


def sync_from_rank0(tensors: list[torch.Tensor], groups: Groups) -> None:
    with torch.no_grad():
        for tensor in tensors:
            collectives.broadcast(tensor, groups.shard)
            collectives.broadcast(tensor, groups.replicate)


def build_units(root: nn.Module, prefixes: list[str], members: dict[str, list[tuple[Member, torch.Tensor]]],
                device: torch.device, groups: Groups, sync_module_states: bool, param_init_fn: InitFn | None,
                build: Callable[[str, list[tuple[Member, torch.Tensor]]], list[FlatGroup]],
                ) -> dict[str, list[FlatGroup]]:
    """Every unit's groups (``build(prefix, members)``), each built as soon as its members exist; the original
    parameters are unregistered from their modules as their unit is built, and ``members`` is consumed (so
    that nothing here holds a built unit's full tensors)."""
    needs = {prefix: {id(module) for member, _ in members[prefix] for module, _ in member.owners}
             for prefix in prefixes}
    ready: set[int] = set()
    built: dict[str, list[FlatGroup]] = {}
    materialised = False
    for name, module in root.named_modules():
        if _on_meta(module):
            materialize(name, module, device, param_init_fn)
            materialised = True
        ready.add(id(module))
        for prefix in prefixes:
            if prefix not in built and needs[prefix] <= ready:
                built[prefix] = _build_unit(members.pop(prefix), groups, sync_module_states,
                                            lambda chosen: build(prefix, chosen))
                if materialised:
                    _return_freed_memory()
    if sync_module_states:
        sync_from_rank0(list(root.buffers()), groups)
    return built


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; absent elsewhere
    except (OSError, AttributeError):
        return None


def _return_freed_memory() -> None:
    """Give the heap pages of a unit's dropped full tensors back to the system. glibc otherwise keeps them
    for reuse (tensors of a few MiB come from its heap once it has raised its mmap threshold), and the next
    units do not reuse them exactly: measured at ws 2, 16 units of 32 MiB, a rank peaked at 1.4-1.7 GiB instead
    of 576 MiB, one run in two."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _build_unit(members: list[tuple[Member, torch.Tensor]], groups: Groups, sync_module_states: bool,
                build: Callable[[list[tuple[Member, torch.Tensor]]], list[FlatGroup]]) -> list[FlatGroup]:
    current = []
    for member, _ in members:
        first, attr = member.owners[0]
        param = first._parameters[attr]
        for owner, owner_attr in member.owners[1:]:  # materialised once per owner: tie them again
            owner._parameters[owner_attr] = param
        current.append((member, param))
    if sync_module_states:
        sync_from_rank0([param.data for _, param in current], groups)
    unit_groups = build(current)
    for member, _ in members:  # the flat shards replace them: drop the full tensors now
        for owner, attr in member.owners:
            owner._parameters.pop(attr, None)
    return unit_groups
