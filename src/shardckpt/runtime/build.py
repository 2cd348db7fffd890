"""Deciding which parameters form which flat group, and building those groups (the body of `shard`)."""
from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn

from shardckpt.errors import ShardingError
from shardckpt.runtime.flat_group import FlatGroup, Member
from shardckpt.format.flat_layout import build_layout
from shardckpt.runtime.process_groups import Groups

WrapPolicy = Union[tuple, Callable[[nn.Module], bool], None]
FLAT_PARAM_NAMES = {True: "_flat_param", False: "_frozen_flat_param"}


def unit_prefixes(root: nn.Module, wrap: WrapPolicy) -> list[str]:
    """FQNs of the modules that get their own groups: the root ('') first, then `named_modules()` order."""
    if wrap is None:
        wants: Callable[[nn.Module], bool] = lambda module: False  # noqa: E731
    elif isinstance(wrap, tuple) and all(isinstance(cls, type) for cls in wrap):
        wants = lambda module: isinstance(module, wrap)  # noqa: E731
    elif callable(wrap) and not isinstance(wrap, type):
        wants = wrap
    else:
        raise ShardingError(f"wrap must be a tuple of module classes or a callable policy(module) -> bool, "
                            f"got {wrap!r}")
    return [""] + [name for name, module in root.named_modules() if name and wants(module)]


def _inside(module_fqn: str, prefix: str) -> bool:
    return prefix == "" or module_fqn == prefix or module_fqn.startswith(prefix + ".")


def assign_parameters(root: nn.Module, prefixes: list[str], shared: frozenset[str] = frozenset(),
                      ) -> dict[str, list[tuple[Member, torch.Tensor]]]:
    """Give every distinct parameter to the innermost unit that contains all the modules owning it.

    A tied or shared parameter thus lands in the lowest common wrapped ancestor of its users (often the
    root), named by its first FQN in `named_parameters()` order; the other FQNs become its aliases. A
    parameter named in ``shared`` goes to the root, gathered for the whole step, wherever it is used.
    """
    fqns_of: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for fqn, param in root.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(param), (param, []))[1].append(fqn)
    unknown = sorted(shared - {fqn for _, fqns in fqns_of.values() for fqn in fqns})
    if unknown:
        raise ShardingError(f"shared_params names {unknown}, which are not parameters of the module")
    by_unit: dict[str, list[tuple[Member, torch.Tensor]]] = {prefix: [] for prefix in prefixes}
    for param, fqns in fqns_of.values():
        owner_modules = [fqn.rpartition(".")[0] for fqn in fqns]
        unit = "" if shared.intersection(fqns) else max(
            (p for p in prefixes if all(_inside(m, p) for m in owner_modules)), key=len)
        owners = tuple((root.get_submodule(mod), fqn.rpartition(".")[2]) for mod, fqn in zip(owner_modules, fqns))
        by_unit[unit].append((Member(fqns[0], tuple(param.shape), owners, tuple(fqns[1:])), param))
    return by_unit


def build_groups(root: nn.Module, prefix: str, members: list[tuple[Member, torch.Tensor]], groups: Groups,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 use_orig_params: bool = False) -> list[FlatGroup]:
    """The unit's trainable group, then its frozen group (each only if it has members)."""
    module = root.get_submodule(prefix)
    built = []
    for requires_grad in (True, False):
        chosen = [(m, p) for m, p in members if p.requires_grad == requires_grad]
        if not chosen:
            continue
        dtypes = {p.dtype for _, p in chosen}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ShardingError(f"the parameters of module {prefix or '<root>'!r} must share one floating dtype "
                                f"to be flattened together, got {sorted(map(str, dtypes))}; cast the module "
                                "or wrap the odd parameters' modules separately")
        master = dtypes.pop()
        layout = build_layout([m.name for m, _ in chosen], [m.shape for m, _ in chosen], master,
                              groups.shard_size, requires_grad=requires_grad,
                              aliases=[m.aliases for m, _ in chosen])
        compute = param_dtype or master
        built.append(FlatGroup(module, prefix, chosen, layout, groups, compute, reduce_dtype or compute,
                               use_orig_params))
    return built


def register_orig_params(root: nn.Module, groups: list[FlatGroup], order: dict[int, list[str]]) -> None:
    """``use_orig_params``: put each member's parameter (this rank's piece) back under every name it had, and
    restore each module's own parameter order (``order``: id(module) -> its names before sharding), so that
    ``named_parameters()`` lists the original names in the unsharded model's order."""
    touched: dict[int, nn.Module] = {}
    for group in groups:
        for member, param in zip(group.members, group.orig_params):
            for module, attr in member.owners:
                module._parameters[attr] = param
                touched[id(module)] = module
    for module in touched.values():
        params = module._parameters
        names = [n for n in order.get(id(module), []) if n in params] + [n for n in params
                                                                         if n not in order.get(id(module), [])]
        kept = [(n, params[n]) for n in names]
        params.clear()
        params.update(kept)
