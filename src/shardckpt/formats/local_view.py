"""``logical_view``: a LOCAL checkpoint presented as the FULL one the same job would have saved (FORMAT.md, "LOCAL
checkpoints", "By parameter").

It lives with the readers, not with the state-dict code: it needs nothing but the read interface and LOCAL's
on-disk layout (``format.flat_layout``), so that ``load``, ``convert``, ``inspect``, ``diff`` and ``export`` read
a LOCAL checkpoint by parameter without importing the training runtime; and it is not part of shardckpt's own
format's reader, since it applies to any reader whose tree holds LOCAL state.

A LOCAL checkpoint stores each flat group as one flat tensor (padding included) and its ``FlatLayout`` in
``model._flat_layouts``; its optimizer state is keyed by flat group. The view presents, through the same
read interface (``formats.api.CheckpointReader``):

- ``model.<fqn>`` for every member parameter, aliases (tied parameters) too, as a FULL model state dict
  lists them: the member's shape, the layout's dtype, no checksum (the flat tensor's does not apply);
  the model's other entries (buffers) pass through unchanged;
- ``optim.state.<fqn or ID>.<key>``: per-parameter state as the member's slice of the flat state tensor,
  reshaped; scalars such as ``step`` replicated per member (primary names only, as FULL has them), with
  their stored checksum;
- ``optim.param_groups`` listing every member, keyed the way the checkpoint's optimizer state is (by name
  or by ID; ID-keyed groups record ``param_names``), in the order of ``param_names``.

A read of region R of a member becomes one read of a flat range of the flat tensor per contiguous run of
R in the member's row-major space; padding is never read and never shows. Any checkpoint that stores no
flat layouts is returned as it is.

Which parameter order FULL uses (the unsharded model's ``named_parameters()``: the IDs, and the order of
the param groups' ``params``) is not the flat layouts' order: a LOCAL state dict records each member's place
in it beside its layout (``positions``), and ``save_state`` in the manifest's ``metadata.param_names``; the
view uses the ``param_names`` given (``unsharded_param_names(model)``), else those, so that an offline
conversion gives what the job's FULL state dict holds, order included. A checkpoint without either (older
ones) gets the stored layouts' order (groups as stored, members in layout order); ID-keyed groups then still
record which name each ID means.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.flat_layout import LAYOUTS_KEY, FlatLayout, is_local, param_order, stored_layouts
from shardckpt.format.param_ids import PARAM_NAMES, hyper_parameters, keyed_by_id, resolve_id_names
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.requests import check_requests
from shardckpt.regions import Run, contiguous_runs

# Where a presented tensor is stored: a stored tensor's name (presented under another name, or its own), or, for
# a member, a run of the stored flat tensor (source: its name) holding the member's elements in order.
Source = str | Run


class LogicalView:
    """A ``CheckpointReader`` presenting a LOCAL checkpoint by its original parameter names (see the module)."""

    def __init__(self, base: CheckpointReader, tree: Any, infos: dict[str, TensorInfo],
                 sources: dict[str, Source], layouts: dict[str, FlatLayout], where: str):
        self.base, self.layouts, self.where = base, layouts, where
        self._tree, self._infos, self._sources = tree, infos, sources

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._infos

    def tree(self) -> Any:
        return self._tree

    def facts(self) -> Facts:
        return self.base.facts()  # the same checkpoint, by parameter

    def source(self, name: str) -> Source:
        """Where the presented tensor ``name`` is stored."""
        return self._sources[name]

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.where)  # every request, before any read
        out: list[ReadRequest] = []
        for request, c in zip(requests, checked):
            src = self._sources[request.tensor]
            if isinstance(src, str):
                out.append(ReadRequest(src, request.region, request.dest))
                continue
            flat = c.flat
            for start, local, count in contiguous_runs(c.region, c.info.shape):
                out.append(ReadRequest(src.source, src.clip(start, start + count).there, flat[local:local + count]))
        if out:
            self.base.read(out)


def logical_view(reader: CheckpointReader, *, param_names: Sequence[str] | None = None) -> CheckpointReader:
    """``reader`` presented as a FULL checkpoint would name it, when it holds LOCAL state (its tree has
    ``model._flat_layouts``); any other checkpoint comes back unchanged.

    ``param_names``: the unsharded model's ``named_parameters()`` names in order
    (``shardckpt.state_dict.unsharded_param_names(model)``), the order a FULL state dict numbers IDs and
    lists param groups in; without it the order ``save_state`` recorded, else the stored layouts'. Inconsistent layouts (a flat
    tensor missing, of another size or dtype than its layout says) raise ``CorruptCheckpointError``
    naming the tensor.
    """
    tree = reader.tree()
    if not is_local(tree):
        return reader
    where = _where(reader)
    if not isinstance(tree["model"][LAYOUTS_KEY], dict):
        raise CorruptCheckpointError(f"{where}: model.{LAYOUTS_KEY} is not a mapping of flat layouts")
    layouts = stored_layouts(tree)
    base = dict(reader.tensors())
    if param_names is None:
        param_names = recorded_param_names(reader)
    builder = _Builder(base, layouts, where, _order(layouts, param_names))
    model = builder.model(tree["model"])
    out = {}
    for key, value in tree.items():
        if key == "model":
            out[key] = model
        elif key == "optim" and isinstance(value, dict):
            out[key] = builder.optim(value)
        else:
            out[key] = copy.deepcopy(value)
    builder.pass_through()
    return LogicalView(reader, out, builder.infos, builder.sources, layouts, where)


def by_parameter_unless_local(reader: CheckpointReader, target: Any) -> CheckpointReader:
    """``reader`` by parameter (``logical_view``) when it holds LOCAL state and ``target``, the state dict
    being loaded, does not; as it is otherwise (a LOCAL target loads the flat tensors as stored)."""
    if is_local(reader.tree()) and not is_local(target):
        return logical_view(reader)
    return reader


def recorded_param_names(reader: CheckpointReader) -> list[str] | None:
    """The unsharded model's parameter order a LOCAL checkpoint records: in the manifest's metadata
    (``save_state``), else in its flat layouts (``positions``: a LOCAL state dict however it was saved); None
    where it records none (older checkpoints)."""
    names = reader.facts().metadata.get("param_names")
    if names is None:
        tree = reader.tree()
        return param_order(tree["model"], _where(reader)) if is_local(tree) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CorruptCheckpointError(f"{_where(reader)}: metadata.param_names is not a list of parameter names")
    return names


def per_parameter_state(optim: dict, layouts: Mapping[str, FlatLayout], id_names: Mapping[int, str]) -> bool:
    """Whether a LOCAL checkpoint's optimizer state is per original parameter (saved with ``use_orig_params``:
    keyed by member name or by an ID naming one, each tensor shaped like its member) rather than per flat
    group (keyed by flat key)."""
    groups = optim.get("param_groups") or []
    keys = list(optim.get("state") or {}) + [p for pg in groups if isinstance(pg, dict) for p in pg.get("params", [])]
    names = [id_names.get(k, k) for k in keys]
    members = {name for layout in layouts.values() for name in layout.names}
    return bool(names) and all(name in members for name in names)


def _where(reader: CheckpointReader) -> str:
    return f"{reader.facts().location} (LOCAL, by parameter)"


def _order(layouts: dict[str, FlatLayout], param_names: Sequence[str] | None) -> dict[str, int]:
    """Position of every member (primary name): in ``param_names``, else in the stored layouts' order."""
    members = [name for layout in layouts.values() for name in layout.names]
    if param_names is None:
        return {name: i for i, name in enumerate(members)}
    if isinstance(param_names, str) or not isinstance(param_names, Sequence):
        raise TypeError(f"param_names must be a sequence of parameter names, got {type(param_names).__name__}")
    position: dict[str, int] = {}
    for i, name in enumerate(param_names):
        if position.setdefault(name, i) != i:
            raise ValueError(f"param_names lists {name!r} twice")
    missing = [name for name in members if name not in position]
    if missing:
        raise IncompatibleCheckpointError(f"param_names does not name the checkpoint's parameters {missing[:3]}"
                                          f"{'...' if len(missing) > 3 else ''}: pass the names of the model "
                                          "that saved it (shardckpt.state_dict.unsharded_param_names(model))")
    return position


class _Builder:
    """Builds the view's tree, tensors and sources from the stored ones."""

    def __init__(self, base: dict[str, TensorInfo], layouts: dict[str, FlatLayout], where: str,
                 position: dict[str, int]):
        self.base, self.layouts, self.where, self.position = base, layouts, where, position
        self.infos: dict[str, TensorInfo] = {}
        self.sources: dict[str, Source] = {}
        self.consumed: set[str] = set()  # stored tensors the view presents otherwise (flat ones, LOCAL optim state)
        self.flat_shape: dict[str, tuple[int, ...]] = {}  # flat key -> its stored flat tensor's shape

    def _add(self, name: str, info: TensorInfo, source: Source) -> TensorRef:
        if name in self.infos:
            raise CorruptCheckpointError(f"{self.where}: the LOCAL checkpoint presents {name!r} twice (a member "
                                         "name listed in two flat layouts, or clashing with a stored tensor)")
        self.infos[name], self.sources[name] = info, source
        return TensorRef(name)

    def _stored(self, ref: Any, what: str) -> TensorInfo:
        if not isinstance(ref, TensorRef) or ref.name not in self.base:
            raise CorruptCheckpointError(f"{self.where}: {what} is not a stored tensor (got {ref!r:.80})")
        return self.base[ref.name]

    def model(self, model: dict) -> dict:
        out: dict[str, Any] = {}
        for key, layout in self.layouts.items():
            info = self._stored(model.get(key), f"model.{key}, the flat tensor of flat layout {key!r},")
            if tuple(info.shape) != (layout.padded_numel,):
                raise CorruptCheckpointError(
                    f"{self.where}: flat tensor {info.name!r} has shape {list(info.shape)}, but its layout "
                    f"model.{LAYOUTS_KEY}.{key} places members up to element {layout.numel} of "
                    f"{layout.padded_numel}: the layout does not describe this tensor")
            if info.dtype != layout.torch_dtype:
                raise CorruptCheckpointError(f"{self.where}: flat tensor {info.name!r} is {info.dtype}, its layout "
                                             f"model.{LAYOUTS_KEY}.{key} says {layout.dtype}")
            self.consumed.add(info.name)
            self.flat_shape[key] = tuple(info.shape)
            for j, name in enumerate(layout.names):
                source = layout.member(j, info.name)
                for fqn in (name,) + layout.aliases[j]:
                    if fqn in out:
                        raise CorruptCheckpointError(f"{self.where}: parameter {fqn!r} appears in two flat layouts")
                    full = f"model.{fqn}"
                    out[fqn] = self._add(full, TensorInfo(full, layout.torch_dtype, layout.shapes[j], None), source)
        for key, value in model.items():
            if key == LAYOUTS_KEY or key in self.layouts:
                continue
            if key in out:
                raise CorruptCheckpointError(f"{self.where}: model.{key} is both stored and a flat layout member")
            out[key] = copy.deepcopy(value)  # buffers and other entries: their TensorRefs pass through
        return out

    def optim(self, optim: dict) -> dict:
        state, groups = optim.get("state") or {}, optim.get("param_groups") or []
        if not isinstance(state, dict) or not isinstance(groups, list):
            raise CorruptCheckpointError(f"{self.where}: optim.state or optim.param_groups is malformed")
        by_id = keyed_by_id({"state": state, "param_groups": groups}) is True
        id_names = resolve_id_names(groups, None, lambda: dict(enumerate(self.layouts))) if by_id else {}
        if per_parameter_state(optim, self.layouts, id_names):
            return copy.deepcopy(optim)  # use_orig_params: keyed and shaped per parameter already, as FULL has it

        def layout_of(key: Any, what: str) -> FlatLayout:
            flat_key = id_names.get(key) if by_id else key
            if flat_key not in self.layouts:
                raise CorruptCheckpointError(f"{self.where}: {what} names {key!r}, which is no stored flat layout")
            return self.layouts[flat_key]

        def out_key(name: str) -> Any:
            return self.position[name] if by_id else name

        members: dict[str, dict] = {}
        for key, entry in state.items():
            layout = layout_of(key, f"optim.state.{key}")
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"{self.where}: optim.state.{key} is not a mapping of state values")
            flat_key = id_names.get(key) if by_id else key
            for j, name in enumerate(layout.names):
                members[name] = self._member_state(entry, key, flat_key, layout, j, out_key(name))
        state_out = {out_key(name): members[name] for name in sorted(members, key=self.position.__getitem__)}
        groups_out = []
        for i, pg in enumerate(groups):
            if not isinstance(pg, dict):
                raise CorruptCheckpointError(f"{self.where}: optim.param_groups[{i}] is not a mapping")
            names = [n for p in pg.get("params", []) for n in layout_of(p, f"optim.param_groups[{i}]").names]
            names.sort(key=self.position.__getitem__)
            group = {**copy.deepcopy(hyper_parameters(pg)), "params": [out_key(n) for n in names]}
            if by_id:
                group[PARAM_NAMES] = names
            groups_out.append(group)
        out = {}
        for key, value in optim.items():
            out[key] = state_out if key == "state" else groups_out if key == "param_groups" else copy.deepcopy(value)
        out.setdefault("state", state_out)
        out.setdefault("param_groups", groups_out)
        return out

    def _member_state(self, entry: dict, key: Any, flat_key: str, layout: FlatLayout, j: int, mkey: Any) -> dict:
        """Member ``j``'s optimizer state: its slice of each flat state tensor, a copy of each scalar."""
        out = {}
        for k, value in entry.items():
            if not isinstance(value, TensorRef):
                out[k] = copy.deepcopy(value)
                continue
            info = self._stored(value, f"optim.state.{key}.{k}")
            self.consumed.add(info.name)
            name = f"optim.state.{mkey}.{k}"
            if tuple(info.shape) == self.flat_shape.get(flat_key):  # flat-shaped: sharded like the parameter
                out[k] = self._add(name, TensorInfo(name, info.dtype, layout.shapes[j], None),
                                   layout.member(j, info.name))
            else:  # a scalar such as step: the same stored bytes under every member's name
                out[k] = self._add(name, TensorInfo(name, info.dtype, tuple(info.shape), info.crc32c), info.name)
        return out

    def pass_through(self) -> None:
        """Every stored tensor the view does not present otherwise, under its own name."""
        for name, info in self.base.items():
            if name not in self.consumed:
                self._add(name, info, name)
