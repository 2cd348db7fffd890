"""``load_state``: model (and optimizer) state from a checkpoint of any type, saved at any world size.

Nothing is gathered. Every piece of memory the model owns on this rank (a slice of a flat shard, a
buffer, a slice of an optimizer state shard) becomes a request for a region of a saved tensor; the
load engine reads just those bytes. Saved FULL or SHARDED state names tensors by FQN, with the
member's own coordinates; saved LOCAL state names flat tensors, whose ``FlatLayout``s (stored with
them) turn a member region into a flat region. So LOCAL checkpoints convert without the model that
wrote them, and wrapping and world size may differ freely.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from shardckpt.checkpoint.load import load_pieces
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.flat_layout import stored_layouts
from shardckpt.regions import FlatRange, Region, full_region
from shardckpt.runtime import FlatGroup, groups, is_sharded
from shardckpt.runtime.flat_group import shards_changed
from shardckpt.runtime.state import state_of
from shardckpt.state_dict.flat import MemberPiece, flat_pieces, held_region
from shardckpt.state_dict.model_state import buffers
from shardckpt.state_dict.optim_state import _held, init_optim_state, names_by_group, unsharded_param_names
from shardckpt.state_dict.param_groups import match_param_groups
from shardckpt.state_dict.plain_optim import plain_names
from shardckpt.state_dict.optim_checks import check_members_agree, same_value
from shardckpt.state_dict.per_param import shaped_like
from shardckpt.format.param_ids import positional_names, resolve_id_names, unknown_ids
from shardckpt.state_dict.rekey import key_type_of
from shardckpt.state_dict.types import OptimStateKeyType
from shardckpt.dist.group import resolve_group
from shardckpt.format.tree import PerRankValues, TensorRef, path_name
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo


# Where the checkpoint holds elements ``region`` of parameter ``names[0]`` (or an alias) of ``shape``:
# (saved tensor, region of it). ``Saved.resolve`` with the prefix and suffix bound.
Resolve = Callable[[tuple[str, ...], tuple[int, ...], FlatRange], tuple[str, Region]]


def _piece_requests(group: FlatGroup, pieces: list[MemberPiece], resolve: Resolve) -> Iterator[ReadRequest]:
    """Reads filling each member piece (of the flat shard, of an original parameter, or of optimizer state
    shaped like either) this rank holds."""
    layout, rank = group.layout, group.groups.shard_rank
    for j, piece, _ in pieces:
        if piece is not None:
            yield ReadRequest(*resolve((layout.names[j],) + layout.aliases[j], layout.shapes[j],
                                       held_region(layout, j, rank)), piece)


def _model_requests(model: nn.Module, resolve: Resolve) -> list[ReadRequest]:
    if not is_sharded(model):
        return [ReadRequest(*resolve((name,), tuple(p.shape), FlatRange(0, p.numel())), p.detach())
                for name, p in model.named_parameters()]
    return [r for group in groups(model) for r in _piece_requests(group, flat_pieces(group, group.flat_param), resolve)]


@dataclass
class Saved:
    """How the checkpoint names model and optimizer tensors (derived once from what its reader shows)."""

    tree: Any
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, Any]
    id_names: dict[int, str] | None = None  # ID -> name (a FQN, or a LOCAL flat key); None: keyed by name
    local: dict[str, tuple[str, int, tuple]] = field(default_factory=dict)  # fqn -> (flat key, offset, shape)
    local_order: list[str] = field(default_factory=list)  # flat keys in layout order
    optim_flat: bool = False  # optimizer state keyed by flat key (LOCAL of flat shards), not by parameter

    @classmethod
    def of(cls, reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           optim_param_names: Sequence[str] | None) -> Saved:
        saved = cls(reader.tree(), reader.tensors(), reader.facts().metadata)
        for key, layout in stored_layouts(saved.tree).items():
            saved.local_order.append(key)
            for j, names in enumerate(zip(layout.names, layout.aliases)):
                for name in (names[0],) + tuple(names[1]):
                    saved.local[name] = (key, layout.offsets[j], layout.shapes[j])
        optim = saved.at("optim")
        if optimizer is not None and isinstance(optim, dict) and key_type_of(optim) is OptimStateKeyType.PARAM_ID:
            groups = optim.get("param_groups") or []
            saved.id_names = resolve_id_names(groups, optim_param_names,
                                              lambda: saved._unrecorded_ids(model, optimizer, groups))
        if isinstance(optim, dict) and isinstance(optim.get("state"), dict):
            keys = [(saved.id_names or {}).get(k, k) for k in optim["state"]]
            saved.optim_flat = any(k in saved.local_order for k in keys)
        return saved

    def _unrecorded_ids(self, model: nn.Module, optimizer: torch.optim.Optimizer, groups: list) -> dict[int, str]:
        """IDs the checkpoint does not name. LOCAL state's IDs always meant its flat parameters in layout order;
        ``save_state`` wrote IDs in the unsharded ``named_parameters()`` order before it recorded names; a
        plain torch optimizer's IDs map onto a live plain optimizer (or one over a ``use_orig_params`` model's
        parameters) as torch maps them. Else: refused."""
        if self.local_order:
            return dict(enumerate(self.local_order))
        if self.metadata.get("optim_key") == OptimStateKeyType.PARAM_ID.value:
            return dict(enumerate(unsharded_param_names(model)))
        if not is_sharded(model):
            return positional_names(groups, plain_names(model, optimizer), "optim_param_names")
        helds = _held(model, optimizer)
        if helds and not helds[0].whole_shard:  # original parameters: an order of their own, as a plain optimizer's
            return positional_names(groups, names_by_group(helds, optimizer), "optim_param_names")
        raise unknown_ids("optim_param_names")

    @functools.cached_property
    def _id_of(self) -> dict[str, int]:
        return {name: i for i, name in (self.id_names or {}).items()}

    def _optim_key(self, key: str) -> Any:
        """How optimizer state names a parameter (or a LOCAL flat key): its ID or the name itself."""
        return self._id_of.get(key) if self.id_names is not None else key

    def resolve(self, prefix: str, names: tuple[str, ...], shape: tuple[int, ...], region: FlatRange,
                suffix: str = "") -> tuple[str, Region]:
        """The saved tensor and region holding ``region`` of parameter ``names[0]``, whose shape is ``shape``."""
        optim = prefix == "optim.state"
        for name in names:
            if name in self.local and (self.optim_flat or not optim):
                key, offset, saved_shape = self.local[name]
                key = self._optim_key(key) if optim else key
                found, region = f"{prefix}.{key}{suffix}", FlatRange(offset + region.start, offset + region.stop)
            else:
                key = self._optim_key(name) if optim else name
                found, saved_shape = f"{prefix}.{key}{suffix}", self.shape_of(f"{prefix}.{key}{suffix}")
                if saved_shape is None:
                    continue
            if tuple(saved_shape) != tuple(shape):  # a region may fit a tensor of another shape: refuse that
                raise IncompatibleCheckpointError(f"the checkpoint's {found!r} is {names[0]!r} of shape "
                                                  f"{list(saved_shape)}, this model's has shape {list(shape)}")
            return found, region
        raise IncompatibleCheckpointError(f"the checkpoint holds no {prefix.split('.')[0]} state for {names[0]!r}"
                                          f"{suffix and f' ({suffix[1:]})'}")

    def at(self, *path: str) -> Any:
        """The saved tree's node at ``path`` (dict keys); None where there is none."""
        node = self.tree
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def shape_of(self, tensor: str) -> tuple[int, ...] | None:
        entry = self.tensors.get(tensor)
        return None if entry is None else tuple(entry.shape)

    def stored_flat(self, names: tuple[str, ...]) -> bool:
        """Whether the checkpoint holds this parameter inside a LOCAL flat tensor."""
        return self.optim_flat and any(name in self.local for name in names)

    def optim_entry(self, names: tuple[str, ...]) -> dict:
        """The saved optimizer state of parameter ``names[0]`` (tensors as TensorRef); {} if none."""
        state = self.at("optim", "state") or {}
        for name in names:
            flat_key = name in self.local and self.optim_flat
            entry = state.get(self._optim_key(self.local[name][0] if flat_key else name))
            if isinstance(entry, dict):
                return entry
        return {}

    def same_value(self, a: Any, b: Any) -> bool:
        """Whether two saved optimizer state values are equal: tensors by dtype, shape and checksum (equal where a
        format stores no checksum), plain values by value."""
        if isinstance(a, TensorRef) and isinstance(b, TensorRef):
            infos = [self.tensors.get(ref.name) for ref in (a, b)]
            if any(info is None for info in infos):
                return False
            (x, y) = [(info.dtype, tuple(info.shape), info.crc32c) for info in infos]
            return x[:2] == y[:2] and (x[2] is None or y[2] is None or x[2] == y[2])
        return not isinstance(a, TensorRef) and not isinstance(b, TensorRef) and same_value(a, b)

    def param_groups_by_name(self) -> list[dict]:
        """The saved param groups, with every parameter given as its member FQNs."""
        out = []
        for pg in self.at("optim", "param_groups") or []:
            names = []
            for p in pg.get("params", []):
                if self.id_names is not None:
                    if p not in self.id_names:
                        raise IncompatibleCheckpointError(f"the checkpoint's param groups list parameter ID {p!r}, "
                                                          "which the IDs' names do not cover")
                    p = self.id_names[p]
                names.extend([n for n, (k, _, _) in self.local.items() if k == p] if p in self.local_order else [p])
            out.append({**pg, "params": names})
        return out


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
               process_group: Any = None, optim_param_names: Sequence[str] | None = None,
               **load_kwargs: Any) -> dict[str, Any]:
    """Load model (and optimizer) state saved by ``save_state`` (any type, world size, wrapping) or by
    ``shardckpt.save({"model": m.state_dict(), "optim": o.state_dict()}, ...)`` of a plain model, or any
    checkpoint ``formats.detect.open_reader`` reads as ``model`` and ``optim`` entries (a DeepSpeed ZeRO one).

    Optimizer state keyed by ID maps IDs to parameters by the ``param_names`` its param groups record
    (``save_state`` records them; so does torch for an optimizer built over ``model.named_parameters()``),
    else by ``optim_param_names`` (the names of IDs 0, 1, ...), else, into a plain model, by this
    optimizer's own param groups as torch's ``load_state_dict`` does; otherwise it is refused.
    Collective. Returns the checkpoint's other top-level entries (e.g. ``{"step": 1000}``, what ``save_state``
    was given as ``extra``): plain values as stored, tensors read whole onto the CPU, and per-rank values
    (``shardckpt.PerRank``) as this rank's own; a rank the save did not have is refused by name, before any
    data is read.
    """
    if is_sharded(model):
        state_of(model).check_not_summoned("load_state()")
    if optimizer is not None:
        init_optim_state(optimizer)
    scalars: list[tuple[dict, str, Any]] = []
    hyper: list[dict] = []
    stateless: list[torch.Tensor] = []  # parameters saved without optimizer state (no gradient yet)
    extras: dict[str, Any] = {}
    rank = resolve_group(process_group).rank

    def build(reader: CheckpointReader) -> list[ReadRequest]:
        scalars.clear()  # a retry (after a concurrent overwrite) starts over
        stateless.clear()
        extras.clear()
        saved = Saved.of(reader, model, optimizer, optim_param_names)
        requests = _extra_requests(saved, rank, extras)
        requests += _model_requests(model, functools.partial(saved.resolve, "model"))
        for name, buf in buffers(model).items():
            requests.append(ReadRequest(f"model.{name}", full_region(buf.shape), buf.detach()))
        if optimizer is not None:
            params = _optimizer_params(model, optimizer)
            requests += _optim_requests(optimizer, params, saved, scalars, stateless)
            # Checked here, before any data is read, so that a refusal leaves model and optimizer as they were.
            hyper[:] = match_param_groups(saved.param_groups_by_name(), optimizer, [p.members for p in params])
            # A tensor hyper-parameter (torch allows a tensor lr) is read like any tensor, not left a TensorRef.
            hyper[:] = [_materialized(values, ("optim", "param_groups"), saved.tensors, rank, requests)
                        for values in hyper]
        return requests

    load_pieces(path, build, process_group=process_group, **load_kwargs)
    shards_changed()  # read straight into the shards: groups kept gathered must gather again
    for state, key, value in scalars:
        state[key] = value
    for param in stateless:  # as torch's load_state_dict leaves a parameter its state dict keeps none for
        optimizer.state.pop(param, None)
    for pg, values in zip(optimizer.param_groups if optimizer is not None else [], hyper):
        pg.update(values)
    return extras


def _extra_requests(saved: Saved, rank: int, out: dict[str, Any]) -> list[ReadRequest]:
    """Fill ``out`` with the top-level entries besides ``model`` and ``optim`` as this rank gets them (see
    ``load_state``), and return the reads of their tensors."""
    requests: list[ReadRequest] = []
    tree = saved.tree if isinstance(saved.tree, dict) else {}
    out.update({k: _materialized(v, (k,), saved.tensors, rank, requests) for k, v in tree.items()
                if k not in ("model", "optim")})
    return requests


def _materialized(node: Any, path: tuple, tensors: Mapping[str, TensorInfo], rank: int,
                  requests: list[ReadRequest]) -> Any:
    """``node`` (a part of the saved tree) as values: each tensor a new CPU tensor that one of the reads added to
    ``requests`` fills, per-rank values this rank's own."""
    if isinstance(node, PerRankValues):
        if rank >= len(node):
            raise IncompatibleCheckpointError(
                f"{path_name(path)!r}: its per-rank values were saved by {len(node)} ranks, so rank {rank} has "
                "none; load it with shardckpt.load into a PerRank target with strict=False to keep your own")
        return _materialized(node[rank], path, tensors, rank, requests)
    if isinstance(node, TensorRef):
        info = tensors[node.name]
        tensor = torch.empty(tuple(info.shape), dtype=info.dtype)
        requests.append(ReadRequest(node.name, full_region(tensor.shape), tensor))
        return tensor
    if isinstance(node, dict):
        return {k: _materialized(v, path + (k,), tensors, rank, requests) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_materialized(v, path + (i,), tensors, rank, requests) for i, v in enumerate(node))
    return node


@dataclass
class _OptimParam:
    param: torch.Tensor
    names: tuple[str, ...]  # every name of every member (a checkpoint may hold state under any)
    members: list[str]  # primary member names (what param groups list)
    member_names: list[tuple[str, ...]]  # per member, its names
    requests: Callable[[torch.Tensor, Resolve], list[ReadRequest]]  # reads filling state shaped like param


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[_OptimParam]:
    """Each parameter the optimizer holds: its member names (aliases too) and how to request its state's pieces."""
    if not is_sharded(model):
        name_of = dict(enumerate(n for names in plain_names(model, optimizer) for n in names))
        params = [p for pg in optimizer.param_groups for p in pg["params"]]
        return [_OptimParam(p, (name_of[i],), [name_of[i]], [(name_of[i],)],
                            lambda t, resolve, n=name_of[i], p=p: [ReadRequest(
                                *resolve((n,), tuple(p.shape), FlatRange(0, p.numel())), t.detach())])
                for i, p in enumerate(params)]
    out = []
    for held in _held(model, optimizer):
        layout = held.group.layout
        per_member = [(layout.names[j],) + layout.aliases[j] for j in held.members]
        out.append(_OptimParam(held.param, tuple(n for names in per_member for n in names), held.names, per_member,
                               lambda t, resolve, h=held: list(_piece_requests(h.group, h.pieces(t), resolve))))
    return out


def _optim_requests(optimizer: torch.optim.Optimizer, params: list[_OptimParam], saved: Saved,
                    scalars: list, stateless: list) -> list[ReadRequest]:
    """Requests for every sharded optimizer state slice; scalar entries go to ``scalars`` for afterwards, parameters
    the checkpoint keeps no state for to ``stateless`` (one left out of the optimizer that saved it is refused
    with the param groups)."""
    requests = []
    for held in params:
        state, names = optimizer.state.get(held.param, {}), held.names
        if not state:
            continue
        entries = [saved.optim_entry(names)] if saved.stored_flat(names) else \
            [saved.optim_entry(member) for member in held.member_names]
        per_member = {k for k, v in state.items() if shaped_like(v, held.param.shape)}
        if not check_members_agree(held.members, entries, saved.same_value, per_member.__contains__):
            stateless.append(held.param)
            continue
        given = entries[0]
        if set(given) != set(state):
            raise IncompatibleCheckpointError(
                f"the checkpoint's optimizer state for {names[0]!r} holds {sorted(given)}, this optimizer keeps "
                f"{sorted(state)}: was it saved from a different kind of optimizer?")
        sharded = [k for k, v in state.items() if _per_param(v, held.param, names, given[k], saved)]
        for key in sharded:
            requests.extend(held.requests(state[key], functools.partial(saved.resolve, "optim.state",
                                                                        suffix=f".{key}")))
        for key in [k for k in state if k not in sharded]:
            value = given[key]
            if isinstance(value, TensorRef):
                entry = saved.tensors[value.name]
                if torch.is_tensor(state[key]) and tuple(entry.shape) != tuple(state[key].shape):
                    raise IncompatibleCheckpointError(
                        f"the checkpoint's {value.name!r} has shape {list(entry.shape)}, this optimizer keeps "
                        f"{key!r} of {names[0]!r} with shape {list(state[key].shape)}")
                temp = torch.empty(entry.shape, dtype=entry.dtype, device=getattr(state[key], "device", "cpu"))
                requests.append(ReadRequest(value.name, full_region(entry.shape), temp))
                value = temp
            scalars.append((state, key, value))
    return requests


def _per_param(value: Any, param: torch.Tensor, names: tuple[str, ...], saved_value: Any, saved: Saved) -> bool:
    """Whether optimizer state ``value`` of ``param`` (a parameter or a flat shard) is per-parameter, read
    piece by piece, rather than a scalar such as ``step``, read whole. A 0-d parameter's per-parameter
    state is 0-d like ``step``: a saved 0-d tensor is its whole value either way, but a LOCAL checkpoint
    holds it inside its flat group's tensor, to be read at the member's offset."""
    if not shaped_like(value, param.shape):
        return False
    if value.dim() > 0:
        return True
    return saved.stored_flat(names) and isinstance(saved_value, TensorRef) and \
        saved.shape_of(saved_value.name) != ()
