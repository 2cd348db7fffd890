"""LOCAL output for ``convert``: a LOCAL checkpoint presented as the same job would have saved it at another
world size, through the read interface, so that ``convert`` plans and writes it like any other output.

A LOCAL checkpoint stores each flat group's flat tensor (model parameter, and every optimizer state tensor
shaped like it) with its ``FlatLayout``. At world size M the layout is re-derived
(``FlatLayout.at_world_size``: the same members, offsets and dtype; padding for M equal shards), and each flat tensor takes the new layout's ``padded_numel``. A range of a new flat tensor is
assembled from the members' elements, read from the stored flat tensor at the member's stored offset, and
zeros for the alignment gaps and the tail padding, as the runtime keeps them. Every other stored tensor
(buffers, scalars such as ``step``) and the rest of the tree (param groups, optimizer keys by name or ID)
pass through unchanged: the flat keys and IDs do not depend on the world size.

Output rank r holds ``layout.shard_range(r)`` of each flat tensor, as the runtime's LOCAL state dict at M
ranks does (``piece_region``); every other tensor is stored whole.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.flat_layout import LAYOUTS_KEY, FlatLayout, is_local, stored_layouts
from shardckpt.format.param_ids import keyed_by_id, resolve_id_names
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.local_view import logical_view, per_parameter_state
from shardckpt.formats.requests import check_requests
from shardckpt.regions import FlatRange, contiguous_runs


def no_layouts_error(where: str, source_type: str) -> IncompatibleCheckpointError:
    """Why a source without flat layouts cannot become LOCAL output, and what to pass instead."""
    return IncompatibleCheckpointError(
        f"{where}: LOCAL output needs the flat layouts (model.{LAYOUTS_KEY}) that only a LOCAL source stores, and "
        f"this {source_type} source has none: convert a LOCAL checkpoint (saved with "
        "type=StateDictType.LOCAL_STATE_DICT), or pass type='sharded', which a runtime at any "
        "world size loads with shardckpt.load_state")


class LocalAtWorldSize:
    """A ``CheckpointReader`` presenting LOCAL checkpoint ``base`` as it would be saved at ``world_size`` ranks."""

    def __init__(self, base: CheckpointReader, world_size: int, where: str):
        tree = base.tree()
        if not is_local(tree):
            raise no_layouts_error(where, "non-LOCAL")
        logical_view(base)  # checks the layouts against the flat tensors (CorruptCheckpointError naming one)
        self.base, self.where, self.world_size = base, where, world_size
        stored = stored_layouts(tree)
        self.layouts = {key: layout.at_world_size(world_size) for key, layout in stored.items()}
        infos = dict(base.tensors())
        # stored flat tensor name -> (its stored layout, the re-derived one)
        self.flat: dict[str, tuple[FlatLayout, FlatLayout]] = {
            name: (stored[key], self.layouts[key]) for name, key in _flat_tensors(tree, infos, stored).items()}
        self._infos = {name: TensorInfo(name, info.dtype, (self.flat[name][1].padded_numel,), None)
                       if name in self.flat else info for name, info in infos.items()}
        # use_orig_params: whether the optimizer state is kept per parameter, and stored tensor name -> (flat key,
        # member) of its tensors
        self.per_parameter_optim, self.member_state = _member_state_tensors(tree, infos, self.layouts)
        self._tree = copy.deepcopy(tree)
        stored_docs = tree["model"][LAYOUTS_KEY]  # what else they record (positions) does not change with the world
        self._tree["model"][LAYOUTS_KEY] = {key: {**stored_docs[key], **layout.to_dict()}
                                            for key, layout in self.layouts.items()}

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._infos

    def facts(self) -> Facts:
        return dataclasses.replace(self.base.facts(), world_size=self.world_size)

    def tree(self) -> Any:
        return self._tree

    def piece_region(self, name: str, rank: int) -> FlatRange | None:
        """The flat range output rank ``rank`` holds of flat tensor ``name`` (or of the member whose per-parameter
        optimizer state ``name`` is); None for a tensor stored whole."""
        if name in self.member_state:  # the member's elements that rank holds in its flat shard
            key, j = self.member_state[name]
            held = self.layouts[key].held(j, rank)
            return FlatRange(0, 0) if held is None else held.here
        if name not in self.flat:
            return None
        return FlatRange(*self.flat[name][1].shard_range(rank))

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.where)
        out: list[ReadRequest] = []
        for request, c in zip(requests, checked):
            if request.tensor not in self.flat:
                out.append(request)
                continue
            stored, new = self.flat[request.tensor]
            flat = c.flat
            flat.zero_()  # alignment gaps and tail padding
            for start, local, count in contiguous_runs(request.region, (new.padded_numel,)):
                out += _member_reads(request.tensor, stored, new, start, start + count, flat[local:local + count])
        if out:
            self.base.read(out)


def _member_reads(name: str, stored: FlatLayout, new: FlatLayout, start: int, stop: int,
                  dest: torch.Tensor) -> list[ReadRequest]:
    """Reads filling ``dest`` (new flat elements [start, stop)) with the members' elements it covers."""
    reads = []
    for j in range(len(new.names)):
        part = new.member(j).clip_source(start, stop)  # the member's elements [at, at + count) land there
        if part is not None:
            src = stored.member(j, name).clip(part.at, part.at + part.count)
            reads.append(ReadRequest(name, src.there, dest[part.start - start:part.start - start + part.count]))
    return reads


def _flat_tensors(tree: dict, infos: Mapping[str, TensorInfo], layouts: dict[str, FlatLayout]) -> dict[str, str]:
    """Stored tensor name -> flat key, for every flat tensor: the model's flat parameters and the optimizer
    state shaped like them (state keyed by flat key, or by ID: the IDs' recorded names, else layout order)."""
    model = tree["model"]
    out = {model[key].name: key for key in layouts if isinstance(model.get(key), TensorRef)}
    optim = tree.get("optim")
    state = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(state, dict):
        return out
    groups = optim.get("param_groups") or []
    by_id = keyed_by_id({"state": state, "param_groups": groups}) is True
    id_names = resolve_id_names(groups, None, lambda: dict(enumerate(layouts))) if by_id else {}
    for k, entry in state.items():
        key = id_names.get(k) if by_id else k
        if key not in layouts or not isinstance(entry, dict):
            continue
        for value in entry.values():
            if isinstance(value, TensorRef) and tuple(infos[value.name].shape) == (layouts[key].padded_numel,):
                out[value.name] = key
    return out


def _member_state_tensors(tree: dict, infos: Mapping[str, TensorInfo], layouts: dict[str, FlatLayout],
                          ) -> tuple[bool, dict[str, tuple[str, int]]]:
    """Whether the optimizer state is what a ``use_orig_params`` run keeps, per parameter (keyed by member name or
    by an ID naming one), and stored tensor name -> (flat key, member index) of its tensors shaped like members."""
    optim = tree.get("optim")
    state = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(state, dict):
        return False, {}
    groups = optim.get("param_groups") or []
    by_id = keyed_by_id({"state": state, "param_groups": groups}) is True
    id_names = resolve_id_names(groups, None, lambda: dict(enumerate(layouts))) if by_id else {}
    if not per_parameter_state(optim, layouts, id_names):
        return False, {}
    where = {name: (key, j) for key, layout in layouts.items() for j, name in enumerate(layout.names)}
    out = {}
    for k, entry in state.items():
        key, j = where[id_names.get(k, k)]
        for value in (entry.values() if isinstance(entry, dict) else ()):
            if isinstance(value, TensorRef) and tuple(infos[value.name].shape) == layouts[key].shapes[j] and \
                    layouts[key].shapes[j]:
                out[value.name] = (key, j)
    return True, out
