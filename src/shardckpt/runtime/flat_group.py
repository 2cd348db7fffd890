"""FlatGroup: one flat parameter, its local shard, its gathered buffer and its gradient reduction."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardckpt.dist import collectives
from shardckpt.dist.collectives import Handle
from shardckpt.errors import ShardingError
from shardckpt.format.flat_layout import FlatLayout
from shardckpt.runtime.process_groups import Groups


@dataclass(frozen=True)
class Member:
    """One parameter of a group and every (module, attribute) it is reachable as (more than one when tied)."""

    name: str
    shape: tuple[int, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    aliases: tuple[str, ...] = ()


class NotGathered(torch.Tensor):
    """What a member's name holds while its group is not gathered: its shape and dtype, and a
    ``ShardingError`` naming it (and the fix) on any other use, instead of a bare ``AttributeError`` from
    deep inside the module that read it (a parameter read outside its unit's forward and backward)."""

    _READABLE = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.shape.__get__,
                 torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__, torch.Tensor.requires_grad.__get__,
                 torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size}

    @staticmethod
    def __new__(cls, name: str, unit: str, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> NotGathered:
        stand_in = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        stand_in.member, stand_in.unit, stand_in._real_device = name, unit, device
        return stand_in

    @property
    def device(self) -> torch.device:
        """The member's device (code that places inputs by a parameter's device reads it; the data is on meta)."""
        return self._real_device

    @property
    def is_cuda(self) -> bool:
        return self._real_device.type == "cuda"

    def __repr__(self) -> str:
        return f"NotGathered({self.member!r} of unit {self.unit!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._READABLE:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        stand_in = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, NotGathered))
        raise ShardingError(
            f"parameter {stand_in.member!r} was used where its unit {stand_in.unit!r} is not gathered: outside that "
            "unit's forward and backward (by another unit's forward, or between steps). Keep it with the root, "
            f"gathered for the whole step: shard(..., shared_params=[{stand_in.member!r}]); or wrap so that its users "
            "share a unit; or read it inside model.summon_full_params()")


_EPOCH = [0]


def shards_epoch() -> int:
    """Bumped by every optimizer step (any optimizer: torch's global step hook) and every state-dict load into a
    sharded model: a group kept gathered across one (``set_reshard_after_backward(False)``) is gathered again,
    as writes that bypass autograd's version counter (fused optimizers, loads straight into the shards'
    memory) would otherwise leave it serving the old weights."""
    return _EPOCH[0]


def shards_changed(*_: object) -> None:
    _EPOCH[0] += 1


register_optimizer_step_post_hook(shards_changed)


def divide_factors(world: int) -> tuple[float, float]:
    """FSDP's split of the 1/world gradient average into a pre- and a post-reduction divide, so that
    low-precision sums neither overflow (divide before) nor underflow (divide only after)."""
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre), world / pre


class FlatGroup:
    """The members of one module (trainable or frozen ones) flattened into one sharded parameter.

    Public: `layout` (FlatLayout), `flat_param` (the local shard: an nn.Parameter, 1-D,
    `layout.shard_numel` long, in the master dtype; what the optimizer holds), `prefix` (the FQN of
    the owning module, '' for the root), `name` (a unique, non-empty key: the prefix, '<root>' for
    the root, plus '<frozen>' for the frozen group of a module), `module`, `groups` (the `Groups`:
    `shard` / `replicate` process groups, `shard_rank`, `shard_size`; `layout.shard_range(groups.shard_rank)`
    is this rank's slice), `unsharded` (whether the gathered compute buffer is allocated now) and, with
    ``use_orig_params``, `orig_params` (per member, an nn.Parameter over this rank's piece of it inside
    `flat_param`, possibly empty, see `orig_piece`; what the optimizer holds then), else None.
    """

    def __init__(self, module: nn.Module, prefix: str, members: list[tuple[Member, torch.Tensor]],
                 layout: FlatLayout, groups: Groups, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 use_orig_params: bool = False) -> None:
        self.module, self.prefix, self.layout = module, prefix, layout
        self.name = (prefix or "<root>") + ("" if layout.requires_grad else "<frozen>")
        self._members, self._groups = [member for member, _ in members], groups
        self._reduce_dtype = reduce_dtype
        self._pre_divide, self._post_divide = divide_factors(groups.data_parallel_size)
        shard = self._local_shard([param for _, param in members])
        self.flat_param = nn.Parameter(shard, requires_grad=layout.requires_grad)
        # The gathered parameter: an autograd leaf whose split views stand in for the originals.
        # Its storage is allocated only while unsharded; collectives write through `_target`, an alias
        # with its own version counter, so refilling it never trips autograd's saved-tensor checks.
        self._full = torch.empty(layout.padded_numel, dtype=compute_dtype, device=self.flat_param.device)
        self._full.requires_grad_(layout.requires_grad)
        self._target = self._full.data
        self._free_storage()
        self._gather: Handle | None = None
        self._gather_src: torch.Tensor | None = None
        self._reduce: tuple[Handle, torch.Tensor] | None = None
        self._pending_grad: torch.Tensor | None = None
        self._gathered_from = (-1, -1)  # (flat_param's version, shards_epoch()) the gathered buffer was made at
        self.unsharded = False
        self._stand_ins = [NotGathered(member.name, prefix or "<root>", member.shape, compute_dtype,
                                       self.flat_param.device) for member in self._members]
        flat = self.flat_param.detach()
        self.orig_params = [nn.Parameter(self.orig_piece(flat, j), requires_grad=layout.requires_grad)
                            for j in range(len(self._members))] if use_orig_params else None
        self._grad_views: list[torch.Tensor] = []  # the orig_params' .grad as finish_grad set them
        self._guard = False  # with orig_params: the root's forward is running (see guard_reads)
        self.drop_views()

    def __repr__(self) -> str:
        layout = self.layout
        return (f"FlatGroup({self.name!r}, {len(layout.names)} members, numel={layout.numel}, "
                f"shard {self._groups.shard_rank}/{layout.world_size} of {layout.shard_numel}, {layout.dtype})")

    @property
    def members(self) -> list[Member]:
        return list(self._members)

    def member_piece(self, flat_shard: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's elements of member ``index`` inside a flat-shard-shaped tensor (a view; empty if none)."""
        held = self.layout.held(index, self._groups.shard_rank)
        return flat_shard[:0] if held is None else flat_shard[held.start:held.start + held.count]

    def orig_piece(self, flat_shard: torch.Tensor, index: int) -> torch.Tensor:
        """``member_piece`` shaped as ``use_orig_params`` exposes it: ``(1, ..., 1, n)`` with the member's number
        of dimensions (1 for a 0-d member). FSDP1 exposes 1-D pieces, which silently turns recipes such as
        "weight decay where ``p.dim() >= 2``" off for every matrix; the leading ones keep ``p.dim()``."""
        piece = self.member_piece(flat_shard, index)
        ndim = len(self._members[index].shape)
        return piece.view((1,) * (ndim - 1) + (piece.numel(),)) if ndim > 1 else piece

    def _shard_version(self) -> int:
        """Changes whenever the local shard is written in place (through an original parameter too: a view made
        by ``nn.Parameter`` has its own version counter)."""
        version = self.flat_param._version
        return version + sum(param._version for param in self.orig_params) if self.orig_params else version

    def _local_shard(self, params: list[torch.Tensor]) -> torch.Tensor:
        layout, rank = self.layout, self._groups.shard_rank
        shard = torch.zeros(layout.shard_numel, dtype=layout.torch_dtype, device=params[0].device)
        with torch.no_grad():
            for index, param in enumerate(params):
                held = layout.held(index, rank)
                if held is not None:
                    shard[held.start:held.start + held.count].copy_(param.reshape(-1)[held.at:held.at + held.count])
        return shard

    # --- gathering ------------------------------------------------------------------------------

    def _free_storage(self) -> None:
        self._full.untyped_storage().resize_(0)

    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather of the flat parameter in the compute dtype; no-op if under way, or if
        gathered already from the shard as it is now (one kept gathered across an optimizer step is refreshed)."""
        if self.unsharded and self._gathered_from != (self._shard_version(), shards_epoch()):
            self.reshard()
        if self.unsharded or self._gather is not None:
            return
        storage = self._full.untyped_storage()
        storage.resize_(self._full.numel() * self._full.element_size())
        self._gathered_from = (self._shard_version(), shards_epoch())
        self._gather_src = self.flat_param.detach().to(self._full.dtype)
        self._gather = collectives.all_gather(self._target, self._gather_src, self._groups.shard, async_op)

    def wait_unshard(self) -> None:
        if self._gather is None and not self.unsharded:
            self.unshard()
        if self._gather is not None:
            self._gather.wait()
            self._gather = self._gather_src = None
            self.unsharded = True

    def use_views(self) -> None:
        """Point every owner attribute at a fresh view of the gathered buffer (a new autograd graph)."""
        sizes, end = [], 0
        for offset, numel in zip(self.layout.offsets, self.layout.numels):
            sizes += [offset - end, numel]
            end = offset + numel
        sizes.append(self.layout.padded_numel - end)
        # Views that require grad even when made in backward (grad mode off there): a checkpointed forward
        # recomputed in backward must save, and differentiate, what the original forward did.
        with torch.enable_grad():
            chunks = torch.split(self._full, sizes)
            for member, chunk in zip(self._members, chunks[1::2]):
                view = chunk.view(member.shape)
                for module, attr in member.owners:
                    module.__dict__[attr] = view

    def reshard(self) -> None:
        """Free the gathered buffer and drop the owner attributes (autograd keeps what it saved)."""
        if self._gather is not None:  # a prefetch nobody used: let it land, then free its buffer
            self.wait_unshard()
        if self.unsharded:
            self._free_storage()
            self.unsharded = False
        self.drop_views()

    def drop_views(self) -> None:
        """Point every owner attribute at the member's ``NotGathered`` stand-in; with ``use_orig_params``, outside
        the root's forward, let it read the registered parameter (this rank's piece) again, as FSDP1 does."""
        stand_ins = self.orig_params is None or self._guard
        for j, (member, stand_in) in enumerate(zip(self._members, self._stand_ins)):
            for module, attr in member.owners:
                if stand_ins:
                    module.__dict__[attr] = stand_in
                else:
                    module.__dict__.pop(attr, None)
                if self.orig_params is not None:  # the piece again after summon_full_params
                    module._parameters[attr] = self.orig_params[j]

    def guard_reads(self, on: bool) -> None:
        """With ``use_orig_params``: while the root's forward runs (``on``), names of members not gathered hold the
        ``NotGathered`` stand-in, so that another unit's forward reading one fails naming it instead of computing
        with this rank's piece (a ``(1, k)`` piece can broadcast silently); between steps they read the pieces
        (optimizer recipes, FSDP1's semantics)."""
        if self.orig_params is not None and self._guard != on:
            self._guard = on
            if not self.unsharded:
                self.drop_views()

    def check_requires_grad(self) -> None:
        """With ``use_orig_params``: refuse, naming it, a frozen member made trainable after ``shard`` (frozen
        members are flattened apart, into a group without gradients: it would silently never train)."""
        if self.orig_params is None or self.layout.requires_grad:
            return
        for member, param in zip(self._members, self.orig_params):
            if param.requires_grad:
                raise ShardingError(
                    f"parameter {member.name!r} was frozen when the model was sharded and has requires_grad=True "
                    "now: frozen parameters are sharded apart, without gradients. Set requires_grad before "
                    "shard(); freezing after shard() is fine (the parameter gets no .grad)")

    # --- gradients ------------------------------------------------------------------------------

    def register_grad_hook(self, hook: Callable[[FlatGroup], None]) -> None:
        """Call `hook(self)` (a bound method) once per backward, when the gathered parameter's gradient is complete.
        Both are held weakly: the garbage collector does not look into a tensor's post-accumulate-grad hooks, so a
        reference from there back to the model would keep every sharded model alive forever."""
        if self.layout.requires_grad:
            group, method = weakref.ref(self), weakref.WeakMethod(hook)
            self._full.register_post_accumulate_grad_hook(lambda _: method()(group()))

    @property
    def has_gathered_grad(self) -> bool:
        """Whether the gathered parameter holds a gradient not yet taken by ``reduce_grad``."""
        return self._full.grad is not None

    def discard_partial_grad(self) -> None:
        """Drop what a backward that raised left: the gathered gradient, and a reduction's result (after it
        completes)."""
        self._full.grad = None
        if self._reduce is not None:
            self._reduce[0].wait()
            self._reduce = None

    def reduce_grad(self, sync: bool) -> None:
        """Take the gathered gradient; keep it for later (no_sync) or start its reduce-scatter."""
        grad, self._full.grad = self._full.grad, None
        if grad is None:
            return
        if not sync:
            self._pending_grad = grad.float() if self._pending_grad is None else self._pending_grad.add_(grad)
            return
        total = grad.to(self._reduce_dtype)  # ours alone now: safe to divide in place
        if self._pending_grad is not None:
            total.add_(self._pending_grad.to(self._reduce_dtype))
            self._pending_grad = None
        if self._pre_divide != 1:
            total.div_(self._pre_divide)
        if self._groups.shard is None:
            self._reduce = (Handle(), total)
            return
        out = torch.empty(self.layout.shard_numel, dtype=self._reduce_dtype, device=total.device)
        self._reduce = (collectives.reduce_scatter(out, total, self._groups.shard, async_op=True), out)

    def set_divide_factor(self, factor: float | None) -> None:
        """Divide the summed gradient by ``factor`` (None: the data-parallel size), split as FSDP splits it."""
        world = self._groups.data_parallel_size if factor is None else factor
        whole = float(world).is_integer() and world >= 1
        self._pre_divide, self._post_divide = divide_factors(int(world)) if whole else (1.0, float(world))

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter and start the all-reduce across replicas (NO_SHARD, HYBRID_SHARD)."""
        if self._reduce is None:
            return
        handle, out = self._reduce
        handle.wait()
        self._reduce = (collectives.all_reduce(out, self._groups.replicate, async_op=True), out)

    def finish_grad(self) -> None:
        """Wait for the reduction, finish the average and accumulate into `flat_param.grad` (master dtype)."""
        if self._reduce is None:
            return
        handle, out = self._reduce
        self._reduce = None
        handle.wait()
        if self._post_divide != 1:
            out.div_(self._post_divide)
        grad = out.to(self.flat_param.dtype)
        current = self._accumulated_grad()
        if current is None:
            self.flat_param.grad = grad
        else:
            self.flat_param.grad = current.add_(grad)
        if self.orig_params is not None:
            self._grad_views = [self.orig_piece(self.flat_param.grad, j) for j in range(len(self._members))]
            for param, view in zip(self.orig_params, self._grad_views):
                param.grad = view if param.requires_grad else None  # frozen after shard(): no gradient, as FSDP1

    def _accumulated_grad(self) -> torch.Tensor | None:
        """The gradient a new one adds to: `flat_param.grad`, or with ``use_orig_params`` what the original
        parameters' ``.grad`` say now (the optimizer's ``zero_grad()`` set them to None, or code replaced some):
        None when all are None, else the flat gradient with those members zeroed or copied in."""
        if self.orig_params is None:
            return self.flat_param.grad
        grads = [param.grad for param in self.orig_params]
        if all(grad is None for grad in grads):
            return None
        flat, fresh = self.flat_param.grad, self.flat_param.grad is None
        if fresh:
            flat = torch.zeros_like(self.flat_param, memory_format=torch.contiguous_format).detach()
        views = self._grad_views if not fresh and self._grad_views else [None] * len(grads)
        for j, (grad, view) in enumerate(zip(grads, views)):
            if grad is None:
                self.member_piece(flat, j).zero_()
            elif grad is not view:
                self.member_piece(flat, j).copy_(grad.reshape(-1))
        return flat

    # --- full master parameters (summon_full_params) ----------------------------------------------

    def gather_master(self) -> torch.Tensor:
        """All-gather the master shards into a new full flat tensor (padded, master dtype)."""
        full = torch.empty(self.layout.padded_numel, dtype=self.flat_param.dtype, device=self.flat_param.device)
        collectives.all_gather(full, self.flat_param.detach(), self._groups.shard)
        return full

    def set_master_views(self, full: torch.Tensor) -> None:
        """Point every owner attribute at the member's part of ``full``; with ``use_orig_params``,
        ``named_parameters()`` yields them too (as parameters over ``full``, as FSDP1's), until ``drop_views``."""
        for j, (member, offset, numel) in enumerate(zip(self._members, self.layout.offsets, self.layout.numels)):
            view = full[offset:offset + numel].view(member.shape)
            if self.orig_params is not None:  # the attribute and named_parameters() give the same object
                view = nn.Parameter(view, requires_grad=self.orig_params[j].requires_grad)
            for module, attr in member.owners:
                module.__dict__[attr] = view
                if self.orig_params is not None:
                    module._parameters[attr] = view

    def write_back(self, full: torch.Tensor) -> None:
        start, stop = self.layout.shard_range(self._groups.shard_rank)
        with torch.no_grad():
            self.flat_param.copy_(full[start:stop])

    def release_dropped_grad(self) -> None:
        """With ``use_orig_params``, once every original parameter's ``.grad`` is None (``optimizer.zero_grad()``),
        drop the flat gradient they were views of, so that it is not kept through the next forward and backward
        (the flat form's ``zero_grad()`` drops it itself)."""
        if self.orig_params is not None and all(param.grad is None for param in self.orig_params):
            self.flat_param.grad = None
            self._grad_views = []

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient, as disjoint tensors: the flat shard's, or with ``use_orig_params`` the original
        parameters' (their `.grad`, which are views of the flat one unless code replaced them)."""
        if self.orig_params is not None:
            grads = [param.grad for param in self.orig_params]
            if self.flat_param.grad is None or any(g is not v for g, v in zip(grads, self._grad_views)):
                return [grad for grad in grads if grad is not None]
        return [] if self.flat_param.grad is None else [self.flat_param.grad]

    def local_grad_norm_power(self, norm_type: float) -> torch.Tensor | None:
        """sum(|g|^p) (or max |g| for inf) over the local gradient, in fp32; None without a gradient."""
        grads = self.local_grads()
        if not grads:
            return None
        parts = [grad.detach().float() for grad in grads if grad.numel()]
        if not parts:  # this rank holds only padding of the group
            return torch.zeros((), dtype=torch.float32, device=self.flat_param.device)
        if norm_type == float("inf"):
            return torch.stack([part.abs().max() for part in parts]).max()
        return sum(torch.linalg.vector_norm(part, norm_type) ** norm_type for part in parts)

    @property
    def groups(self) -> Groups:
        return self._groups
