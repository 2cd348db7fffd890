"""The public entry points: `shard` and the functions that act on a sharded model."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from shardckpt.dist import collectives
from shardckpt.errors import ShardingError
from shardckpt.runtime.build import (
    FLAT_PARAM_NAMES, WrapPolicy, assign_parameters, build_groups, register_orig_params, unit_prefixes,
)
from shardckpt.runtime.config import BackwardPrefetch, MixedPrecision, ShardingStrategy, backward_prefetch_of
from shardckpt.runtime.flat_group import FlatGroup, shards_changed
from shardckpt.runtime.materialize import build_units
from shardckpt.runtime.process_groups import resolve_groups
from shardckpt.runtime.state import ShardState, Unit, register, sharded_root_of, state_of


def shard(
    module: nn.Module,
    *,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    wrap: WrapPolicy = None,
    mixed_precision: MixedPrecision | None = None,
    process_group: Any = None,
    device: torch.device | str | None = None,
    sync_module_states: bool = False,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    reshard_after_forward: bool | None = None,
    backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE,
    shared_params: Sequence[str] = (),
    use_orig_params: bool = False,
) -> nn.Module:
    """Shard `module` in place (ZeRO-3 style) and return it.

    - `wrap`: a tuple of module classes, or a callable `policy(module) -> bool`, naming the submodules
      whose parameters form their own group; the root holds the rest.
    - `process_group`: None (the default group; a single process without one is a world of 1), a
      ProcessGroup, a 1-D DeviceMesh, or for HYBRID_SHARD a `(shard_group, replicate_group)` pair or a
      2-D DeviceMesh with dims (replicate, shard). HYBRID_SHARD without groups shards within blocks of
      LOCAL_WORLD_SIZE consecutive ranks (the whole world if unset).
    - `device`: where the parameters must already be (or, for a model built on the meta device, be
      materialised); None takes their (single) device.
    - `sync_module_states`: broadcast rank 0's parameters and buffers first, so that ranks may start from
      different initialisations; without it every rank must hold identical initial weights.
    - `param_init_fn(module)`: for a model built on the `meta` device, materialises and initialises one
      module's own parameters and buffers (default: `to_empty` and its `reset_parameters()`); modules are
      materialised in `named_modules()` order and each unit is sharded as soon as its members exist, so
      only its shard stays (see `runtime.materialize`).
    - `reshard_after_forward`: free every unit but the root after its forward (default: the strategy's
      choice, True for FULL_SHARD and HYBRID_SHARD); per unit, `unit.set_reshard_after_forward(bool)`.
    - `backward_prefetch`: `BackwardPrefetch.BACKWARD_PRE` (default), `BACKWARD_POST` or None (FSDP1's
      choice; torch's own enum is accepted).
    - `shared_params`: names of parameters used outside their unit's forward (a table every block reads):
      they join the root's group, gathered for the whole step. Used elsewhere without it, such a parameter
      raises a ShardingError naming it and this fix (`runtime.flat_group.NotGathered`).

    - `use_orig_params`: `parameters()` / `named_parameters()` yield the original parameters under their
      original names, each this rank's piece of it (possibly empty; shaped ``(1, ..., 1, k)`` to keep
      ``p.dim()``), as FSDP1's ``use_orig_params=True``:
      optimizer param groups may then be built per parameter (weight decay on matrices only, another learning
      rate for embeddings). False (the default, as FSDP1): one flat shard per group (see docs/runtime.md).

    Every module the wrap policy names, and the root, gain FSDP2's methods: `unshard(async_op)`,
    `reshard()`, `set_reshard_after_forward`, `set_modules_to_forward_prefetch`,
    `set_modules_to_backward_prefetch`; the root also `set_requires_gradient_sync`,
    `set_reshard_after_backward` and `set_gradient_divide_factor` (see `ShardedUnit`, `ShardedModule`).

    After sharding, `module.parameters()` yields one flat shard per group (see `groups`), or with
    `use_orig_params` each original parameter's piece, which is what an optimizer should be built over. The
    original parameter names are plain tensor attributes while their group is gathered (during
    forward/backward, or inside `summon_full_params`); otherwise `NotGathered` stand-ins, or with
    `use_orig_params` the registered pieces.
    """
    _check_not_sharded(module)
    if not isinstance(strategy, ShardingStrategy):
        raise ShardingError(f"strategy must be a ShardingStrategy, got {strategy!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ShardingError(f"mixed_precision must be a MixedPrecision, got {mixed_precision!r}")
    device = _check_device(module, device)
    if param_init_fn is not None and not callable(param_init_fn):
        raise ShardingError(f"param_init_fn must be a callable fn(module), got {param_init_fn!r}")
    groups = resolve_groups(strategy, process_group, device)
    mp = mixed_precision or MixedPrecision()
    prefixes = unit_prefixes(module, wrap)
    # The unsharded parameter order: get_state_dict numbers optimizer IDs by it.
    param_names = tuple(name for name, _ in module.named_parameters())
    if isinstance(shared_params, str):
        raise ShardingError("shared_params takes a sequence of parameter names, not one string")
    if not isinstance(use_orig_params, bool):
        raise ShardingError(f"use_orig_params must be a bool, got {use_orig_params!r}")
    members = assign_parameters(module, prefixes, frozenset(shared_params))
    param_order = {id(sub): list(sub._parameters) for sub in module.modules()}
    built = build_units(module, prefixes, members, device, groups, bool(sync_module_states), param_init_fn,
                        lambda prefix, chosen: build_groups(module, prefix, chosen, groups, mp.param_dtype,
                                                            mp.reduce_dtype, use_orig_params))
    units = [Unit(module.get_submodule(prefix), prefix, built[prefix]) for prefix in prefixes
             if built[prefix] or prefix == ""]
    # Units in pre-order, trainable before frozen: the order of the flat shards in module.parameters().
    flat_groups = [g for u in units for g in u.groups]
    if use_orig_params:
        register_orig_params(module, flat_groups, param_order)
    else:
        _register_flat_params(units)
    _cast_buffers(module, mp.buffer_dtype)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ShardingError(f"reshard_after_forward must be a bool or None, got {reshard_after_forward!r}")
    state = ShardState(module, units, flat_groups, param_names, strategy, mixed_precision, reshard_after_forward,
                       backward_prefetch_of(backward_prefetch))
    state.install()
    register(state)
    for unit in units:
        if unit.module is not module:
            unit.module.__class__ = _sharded_class(type(unit.module), ShardedUnit)
    module.__class__ = _sharded_class(type(module), ShardedModule)
    return module


def _check_not_sharded(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ShardingError(f"shard() takes an nn.Module, got {type(module).__name__}")
    for name, sub in module.named_modules():
        root = sharded_root_of(sub)
        if root is not None:
            where = "this module" if not name else f"its submodule {name!r}"
            raise ShardingError(f"shard() was already called on {where} (or a model containing it); "
                                "a module can be sharded only once")


def _check_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device the groups live on; parameters on ``meta`` are materialised there (``runtime.materialize``)."""
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        wrong = [name for name, p in module.named_parameters() if p.device != device and not p.is_meta]
        if wrong:
            raise ShardingError(f"parameter {wrong[0]!r} (and {len(wrong) - 1} more) is on "
                                f"{module.get_parameter(wrong[0]).device}, not on device={device}; "
                                f"move the module there first (module.to({str(device)!r}))")
        return device
    if len(devices) > 1:
        raise ShardingError(f"the module's parameters are on several devices {sorted(map(str, devices))}; "
                            "move them to one device before sharding")
    return devices.pop() if devices else torch.device("cpu")


def _register_flat_params(units: list[Unit]) -> None:
    """Register each unit's flat shards where its original parameters were (``build_units`` removed those)."""
    for unit in units:
        for group in unit.groups:
            name = FLAT_PARAM_NAMES[group.layout.requires_grad]
            if hasattr(unit.module, name):
                raise ShardingError(f"module {unit.prefix or '<root>'!r} already has an attribute {name!r}, "
                                    "which shard() needs for its flat parameter")
            unit.module.register_parameter(name, group.flat_param)


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_floating_point():
                sub._buffers[name] = buf.to(dtype)


def _state(module: nn.Module, what: str) -> ShardState:
    state = state_of(module)
    if state is None:
        raise ShardingError(f"{what} needs the module returned by shard() (the root of a sharded model); "
                            f"got an unsharded {type(module).__name__}")
    return state


def is_sharded(module: nn.Module) -> bool:
    """True for a module returned by `shard` (the root of a sharded model), False otherwise."""
    return state_of(module) is not None


def groups(module: nn.Module) -> list[FlatGroup]:
    """The flat groups of a sharded model, in `module.parameters()` order of their flat shards (the order they
    would have with ``use_orig_params``).

    That order is the module's pre-order traversal (the root first, then wrapped submodules in
    `named_modules()` order), trainable before frozen within a module: the same on every rank and at
    every world size.
    """
    return list(_state(module, "groups()").groups)


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded, fp32) without communication; the first backward
    after the context reduces them together with its own. They are not visible as `.grad` until
    then, so `zero_grad()` in between does not discard them."""
    state = _state(module, "no_sync()")
    previous, state.sync_grads = state.sync_grads, False
    try:
        yield
    finally:
        state.sync_grads = previous


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of all shards by their global norm (as the unsharded model's
    `torch.nn.utils.clip_grad_norm_` would); return that norm (fp32, on the shards' device)."""
    state = _state(module, "clip_grad_norm_()")
    norm_type = float(norm_type)
    trainable = [g for g in state.groups if g.local_grads()]
    device = state.groups[0].flat_param.device if state.groups else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in trainable:
        part = group.local_grad_norm_power(norm_type)
        total = torch.maximum(total, part) if norm_type == float("inf") else total + part
    if state.groups:
        # Shards are disjoint within a shard group and copies across replicas: reduce over the former.
        op = "max" if norm_type == float("inf") else "sum"
        collectives.all_reduce(total, state.groups[0].groups.shard, op=op)
    norm = total if norm_type == float("inf") else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for group in trainable:
        for grad in group.local_grads():
            grad.mul_(coef.to(grad.dtype))
    return norm


@contextlib.contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Expose the full master parameters under their original names for the body of the context.

    With `writeback=True`, changes made through them are copied back into this rank's shards on exit
    (each rank writes only its own shard). Not allowed between forward and backward.
    """
    state = _state(module, "summon_full_params()")
    state.check_idle("summon_full_params()")
    fulls = []
    with torch.no_grad():
        for group in state.groups:
            full = group.gather_master()
            group.set_master_views(full)
            fulls.append(full)
    state.summoned += writeback  # only a write-back undoes a load made inside
    try:
        yield
        if writeback:  # not when the body raised
            for group, full in zip(state.groups, fulls):
                group.write_back(full)
            shards_changed()
    finally:
        state.summoned -= writeback
        for group in state.groups:
            group.drop_views()


class UnshardHandle:
    """An ``unshard(async_op=True)`` in flight: ``wait()`` completes it (idempotent)."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_and_use_views()
            self._unit = None


class ShardedUnit:
    """Mixed into the class of every unit of a sharded model (the root and each module the wrap policy names):
    FSDP2's explicit controls, acting on this unit's own groups."""

    def _unit(self, what: str) -> Unit:
        root = sharded_root_of(self)
        state = state_of(root) if root is not None else None
        if state is None:
            raise ShardingError(f"{what}: this module is not part of a sharded model")
        return state.unit_of(self, what)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters and expose them under their original names (FSDP2's
        ``unshard``); with ``async_op=True`` return a handle whose ``wait()`` completes it. The next forward
        uses them without gathering again; it frees them afterwards as the unit's policy says."""
        unit = self._unit("unshard()")
        unit.unshard(async_op=async_op)
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters (FSDP2's ``reshard``)."""
        self._unit("reshard()").reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """Free this unit after its forward (True) or keep it gathered until its backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ShardingError(f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}")
        self._unit("set_reshard_after_forward()").reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """As this unit's forward starts, start gathering these units (instead of the next in the recorded order)."""
        unit = self._unit("set_modules_to_forward_prefetch()")
        unit.forward_prefetch = [self._other(m, "set_modules_to_forward_prefetch()") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """As this unit's backward starts (or its gradient is ready, with BACKWARD_POST), start gathering these
        units (instead of the one before it in the recorded order)."""
        unit = self._unit("set_modules_to_backward_prefetch()")
        unit.backward_prefetch = [self._other(m, "set_modules_to_backward_prefetch()") for m in modules]

    def _other(self, module: nn.Module, what: str) -> Unit:
        root = sharded_root_of(self)
        if sharded_root_of(module) is not root:
            raise ShardingError(f"{what}: {type(module).__name__} is not a unit of the same sharded model")
        return state_of(root).unit_of(module, what)


class ShardedModule(ShardedUnit):
    """Mixed into the class of every module `shard` returns: the functions above as methods, FSDP2's
    explicit controls for the root unit (``ShardedUnit``), and the whole model's switches."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward keeps gradients unsharded and unreduced until a backward with True (FSDP2's form
        of ``no_sync``; the same accumulation)."""
        _state(self, "set_requires_gradient_sync()").sync_grads = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """False: units stay gathered after backward, so that the next forward (gradient accumulation) gathers
        nothing; a unit whose shard changed since (an optimizer step, a load) is gathered again anyway."""
        _state(self, "set_reshard_after_backward()").reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of the data-parallel size (1: sums)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ShardingError(f"set_gradient_divide_factor takes a positive number, got {factor!r}")
        for group in _state(self, "set_gradient_divide_factor()").groups:
            group.set_divide_factor(float(factor))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return no_sync(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(self, max_norm, norm_type)

    def summon_full_params(self, writeback: bool = True) -> contextlib.AbstractContextManager[None]:
        return summon_full_params(self, writeback)

    def state_dict(self, *, keep_vars: bool = False, **kwargs: Any) -> dict[str, Any]:
        """The model state of the type ``shardckpt.state_dict_type`` sets (FULL outside it); collective."""
        if kwargs.get("destination") is not None or kwargs.get("prefix"):
            raise ShardingError("state_dict() of a sharded model takes no destination or prefix; call it on the "
                                "root returned by shard()")
        return _module_state_handlers().get(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load model state of the type ``shardckpt.state_dict_type`` sets (FULL outside it); collective."""
        if assign:
            raise ShardingError("load_state_dict(assign=True) cannot replace the flat shards of a sharded model")
        missing, unexpected = _module_state_handlers().set(self, state_dict, strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


@dataclasses.dataclass(frozen=True)
class ModuleStateHandlers:
    """What a sharded module's own ``state_dict()``/``load_state_dict()`` do. The runtime knows nothing of
    state-dict types: ``shardckpt.state_dict`` installs its handlers when imported (the one-way seam)."""

    get: Callable[[nn.Module], dict[str, Any]]
    set: Callable[[nn.Module, dict[str, Any], bool], tuple[list[str], list[str]]]


_HANDLERS: list[ModuleStateHandlers] = []
STATE_DICT_PACKAGE = "shardckpt.state_dict"  # registers the handlers when imported


def register_module_state_handlers(handlers: ModuleStateHandlers) -> None:
    _HANDLERS[:] = [handlers]


def _module_state_handlers() -> ModuleStateHandlers:
    if not _HANDLERS:
        # Installed on first use, by name: `import shardckpt` is lazy (it imports no layer until a name is
        # used), so `from shardckpt.runtime import shard` alone must still find the handlers. Not an import
        # of state_dict's code here: the handlers stay state_dict's, registered by its own import.
        importlib.import_module(STATE_DICT_PACKAGE)
    if not _HANDLERS:
        raise ShardingError(f"no state-dict handlers are installed: {STATE_DICT_PACKAGE} registered none")
    return _HANDLERS[0]


_SHARDED_CLASSES: dict[tuple[type, type], type] = {}


def _sharded_class(cls: type, mixin: type) -> type:
    if (cls, mixin) not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[(cls, mixin)] = type(f"Sharded{cls.__name__}", (mixin, cls), {})
    return _SHARDED_CLASSES[(cls, mixin)]
