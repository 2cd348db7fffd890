"""The per-model runtime state and the module/autograd hooks that drive gathering and reduction.

One `ShardState` per `shard()` call, kept on the root module (no state is hung on the user's
submodules). Each wrapped module (and the root) is a `Unit` with up to two FlatGroups
(trainable and frozen members). The sequence, per unit:

forward:  pre-hook: all-gather (or wait for the prefetch), point the original names at views,
          prefetch the next unit in the recorded forward order;
          post-hook: free (FULL_SHARD, HYBRID_SHARD, or when no backward will follow), and hook the
          outputs so that backward re-gathers first.
backward: output-gradient hook: all-gather again if freed, point the original names at it again (a
          checkpointed forward recomputed now reads them), prefetch the unit that finished its
          forward just before this one (it runs backward next);
          gradient-ready hook (per group): start the reduce-scatter, free the buffer;
          end of backward (engine callback): finish every reduction, free what is left.

Activation checkpointing: a unit's forward run again inside backward (``checkpoint`` around the unit, or
inside it around a nested unit) gathers as usual but leaves the unit gathered and records nothing: its
backward follows at once, and its gradient-ready hook frees it. A reentrant checkpoint runs its own
backward pass inside the outer one: around a whole unit (its forward ran without grad, so the outer
pass holds none of its uses) the inner pass's gradient is complete and reduced at once; inside a unit's
forward it is kept and reduced once with the rest of the group's, when the outer pass accumulates the
group, or at the end of backward.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from shardckpt.errors import ShardingError
from shardckpt.runtime.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from shardckpt.runtime.flat_group import FlatGroup

_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class Unit:
    """A module whose parameters form their own group(s): the root, or one named by the wrap policy."""

    def __init__(self, module: nn.Module, prefix: str, groups: list[FlatGroup]) -> None:
        self.module, self.prefix, self.groups = module, prefix, groups
        self.forward_had_grad = True  # its last forward ran with grad enabled (not inside a reentrant checkpoint)
        self.reshard_after_forward = False  # set by ShardState from the strategy, or by the user
        # Units to prefetch as this one's forward / backward starts; None: the recorded order's neighbour.
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None

    @property
    def unsharded(self) -> bool:
        return any(group.unsharded for group in self.groups)

    def unshard(self, async_op: bool) -> None:
        for group in self.groups:
            group.unshard(async_op)

    def wait_and_use_views(self) -> None:
        for group in self.groups:
            group.wait_unshard()
            group.use_views()

    def wait(self) -> None:
        for group in self.groups:
            group.wait_unshard()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()


class _Order:
    """The order units ran in (pre- or post-forward) during the first forward."""

    def __init__(self) -> None:
        self.units: list[Unit] = []
        self._index: dict[int, int] = {}

    def record(self, unit: Unit) -> None:
        self._index[id(unit)] = len(self.units)
        self.units.append(unit)

    def neighbour(self, unit: Unit, step: int) -> Unit | None:
        if id(unit) not in self._index:
            return None
        index = self._index[id(unit)] + step
        return self.units[index] if 0 <= index < len(self.units) else None


class ShardState:
    """Everything `shard()` set up for one root module, and the hooks that use it."""

    def __init__(self, root: nn.Module, units: list[Unit], groups: list[FlatGroup], param_names: tuple[str, ...],
                 strategy: ShardingStrategy, mixed_precision: MixedPrecision | None,
                 reshard_after_forward: bool | None = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE) -> None:
        self.root, self.units, self.groups = root, units, groups
        # The unsharded model's named_parameters() order (get_state_dict numbers optimizer IDs by it).
        self.param_names = param_names
        self.strategy, self.mixed_precision = strategy, mixed_precision
        self.sync_grads = True
        self.reshard_after_backward = True
        self.backward_prefetch = backward_prefetch
        default = strategy in _RESHARD_AFTER_FORWARD if reshard_after_forward is None else reshard_after_forward
        for unit in units:
            unit.reshard_after_forward = default and unit.module is not root  # the root's backward starts first
        self._unit_of_module = {id(unit.module): unit for unit in units}
        # Forward prefetches along the pre-forward order; backward along the post-forward order,
        # reversed: the unit that finished forward just before this one runs backward just after it.
        self._forward_order, self._backward_order = _Order(), _Order()
        self._recording = True
        self._callback_queued = False
        self._root_forward_finished = True  # False from the root's pre-forward until its post-forward hook ran
        self._backward_task: int | None = None  # the autograd graph task of the backward under way
        self._awaiting_backward = False  # a forward with grad ran; its backward has not finished
        self.summoned = 0  # summon_full_params() contexts open: their exit writes the full parameters back
        self._backward_started: set[int] = set()  # units whose backward began in the pass under way
        self._unit_of = {id(group): unit for unit in units for group in unit.groups}

    def install(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, a, k, u=unit: self._pre_forward(u, a, k),
                                                  with_kwargs=True)
            unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
            for group in unit.groups:
                group.register_grad_hook(self._on_grad_ready)
        self.root.register_forward_hook(lambda *_: self._after_root_forward(), always_call=True)

    # --- forward ------------------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if _in_backward():  # recomputed by activation checkpointing inside backward
            unit.unshard(async_op=False)
            unit.wait_and_use_views()
            return None
        if unit.module is self.root and self._callback_queued:
            self._abandon_backward()  # the last backward raised before its end: start clean
        if unit.module is self.root:
            for group in self.groups:
                group.check_requires_grad()  # before anything is gathered
                group.release_dropped_grad()
            self._guard_reads(True)
            self._root_forward_finished = False
        if unit.module is self.root and self._forward_order.units:
            self._recording = False  # the first forward is over: prefetch from now on
        if self._recording:
            self._forward_order.record(unit)
        unit.unshard(async_op=False)
        unit.wait_and_use_views()
        self._prefetch(self._forward_order, unit, 1, unit.forward_prefetch)
        if unit.module is self.root and self.mixed_precision and self.mixed_precision.param_dtype:
            dtype = self.mixed_precision.param_dtype
            return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x,
                            (args, kwargs))
        return None

    def _after_root_forward(self) -> None:
        """After the root's forward, whatever happened (after its post-forward hook; also when it raised): the names
        read the pieces again; a forward that raised frees what it gathered, and its partial order is forgotten."""
        if _in_backward():
            return
        if not self._root_forward_finished:
            if self._recording:
                self._forward_order, self._backward_order = _Order(), _Order()
            for unit in self.units:
                unit.reshard()
        self._guard_reads(False)

    def _guard_reads(self, on: bool) -> None:
        if not _in_backward():  # a recomputed root forward leaves the names as they are
            for group in self.groups:
                group.guard_reads(on)

    def _prefetch(self, order: _Order, unit: Unit, step: int, chosen: list[Unit] | None) -> None:
        """Start the all-gather of the units ``chosen`` for this one, else of the unit `step` places away in
        `order` (from the second step on), to overlap with compute."""
        targets = chosen if chosen is not None else [] if self._recording else [order.neighbour(unit, step)]
        for other in targets:
            # in backward, not a unit whose backward ran already (BACKWARD_POST after the last unit's)
            if other is not None and id(other) not in self._backward_started:
                other.unshard(async_op=True)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if _in_backward():  # a recomputation: its backward runs next, then frees it
            return
        self._root_forward_finished |= unit.module is self.root
        if self._recording:
            self._backward_order.record(unit)
        grad_enabled = unit.forward_had_grad = torch.is_grad_enabled()
        self._awaiting_backward |= grad_enabled
        if not grad_enabled or unit.reshard_after_forward:  # without grad no backward follows
            unit.reshard()
        if grad_enabled:
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            for tensor in tensors:
                tensor.register_hook(lambda grad, u=unit: self._pre_backward(u, grad))

    # --- backward -----------------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        if not self._callback_queued:
            self._callback_queued = True
            self._backward_task = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        self._backward_started.add(id(unit))
        unit.unshard(async_op=False)  # a no-op for groups still gathered (or being gathered)
        unit.wait_and_use_views()  # a checkpointed part of its forward, recomputed now, reads the names
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._backward_order, unit, -1, unit.backward_prefetch)
        return grad

    def _on_grad_ready(self, group: FlatGroup) -> None:
        inner_pass = torch._C._current_graph_task_id() != self._backward_task
        if inner_pass and self._unit_of[id(group)].forward_had_grad:
            return  # a reentrant checkpoint inside the unit's forward: the outer pass may accumulate more
        group.reduce_grad(self.sync_grads)
        if self.reshard_after_backward:
            group.reshard()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            unit = self._unit_of[id(group)]
            self._prefetch(self._backward_order, unit, -1, unit.backward_prefetch)

    def _post_backward(self) -> None:
        self._callback_queued = False
        self._backward_task = None
        self._awaiting_backward = False
        self._backward_started.clear()
        for group in self.groups:  # accumulated by reentrant checkpoints only: complete now
            if group.has_gathered_grad:
                group.reduce_grad(self.sync_grads)
        for group in self.groups:
            group.finish_reduce_scatter()
        for group in self.groups:
            group.finish_grad()
        if self.reshard_after_backward:
            for unit in self.units:
                unit.reshard()

    def _abandon_backward(self) -> None:
        """Forget a backward that raised (its end-of-backward callback never ran): its partial gradients are
        dropped (reductions under way are waited for, so ranks stay matched), every unit freed."""
        self._callback_queued = False
        self._backward_task = None
        self._awaiting_backward = False
        self._backward_started.clear()
        for group in self.groups:
            group.discard_partial_grad()
        for unit in self.units:
            unit.reshard()

    # --- queries used by the public functions -----------------------------------------------------------

    def unit_of(self, module: nn.Module, what: str) -> Unit:
        """The unit ``module`` is (the root, or a module the wrap policy named)."""
        unit = self._unit_of_module.get(id(module))
        if unit is None:
            raise ShardingError(f"{what}: {type(module).__name__} is not a unit of this sharded model (the root, or "
                                "a module its wrap policy named)")
        return unit

    def check_not_summoned(self, what: str) -> None:
        """Refuse a load inside ``summon_full_params()``: the context's exit would write the full parameters of
        before the load back over the loaded shards."""
        if self.summoned:
            raise ShardingError(f"{what} cannot run inside summon_full_params(): on exit it writes the full "
                                "parameters back over what was loaded; load before or after the context")

    def check_idle(self, what: str) -> None:
        """Refuse between a forward with grad and its backward; free units kept gathered otherwise (after
        backward with ``set_reshard_after_backward(False)``, or by an explicit ``unshard()``)."""
        busy = [unit for unit in self.units if unit.unsharded]
        if busy and self._awaiting_backward:
            raise ShardingError(f"{what} cannot run between forward and backward: groups "
                                f"{[unit.prefix or '<root>' for unit in busy]} are gathered for compute; call it "
                                "after backward (or before forward)")
        for unit in busy:
            unit.reshard()


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


# The state lives on its root module (a reference cycle the garbage collector frees with the model): a registry
# keyed by the root would keep every sharded model alive forever, since its state refers back to the root.
_STATE_ATTR = "_shardckpt_state"
# Every module inside a sharded tree -> its root (held weakly), to refuse sharding (part of) a sharded model again.
_MEMBERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def register(state: ShardState) -> None:
    state.root.__dict__[_STATE_ATTR] = state
    root = weakref.ref(state.root)
    for module in state.root.modules():
        _MEMBERS[module] = root


def state_of(module: nn.Module) -> ShardState | None:
    return module.__dict__.get(_STATE_ATTR)


def sharded_root_of(module: nn.Module) -> nn.Module | None:
    root = _MEMBERS.get(module)
    return None if root is None else root()
