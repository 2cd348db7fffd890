"""What ``convert`` makes of a source, decided before anything is written: the output's world size and type,
the reader the output is made of (the source by parameter, or a LOCAL source at the new world size), the
optimizer state's key type, and the output's encoded tree and tensors after ``only`` / ``exclude``, the rekey,
``strip_prefix`` and the cast, checked as ``save`` checks a state dict. ``offline.convert`` writes it."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from shardckpt.checkpoint.load_any import pick, replace_refs, wanted_keys
from shardckpt.checkpoint.stage import check_unique_names
from shardckpt.offline.local_output import LocalAtWorldSize, no_layouts_error
from shardckpt.offline.spec import ConvertSpec
from shardckpt.offline.streams import Output
from shardckpt.errors import IncompatibleCheckpointError, UnsupportedValueError
from shardckpt.format.tree import TensorRef, check_savable_depth, encode, leaves, path_name
from shardckpt.formats.api import CheckpointReader
from shardckpt.format.flat_layout import LAYOUTS_KEY, is_local
from shardckpt.format.manifest import FORMAT_NAME
from shardckpt.formats.local_view import logical_view, recorded_param_names
from shardckpt.state_dict.rekey import key_type_of, keyed_by_name, rekey_optim_state_dict
from shardckpt.state_dict.types import OptimStateKeyType, StateDictType
from shardckpt.io import where

# save_state's metadata names the type by StateDictType value ("SHARDED_STATE_DICT"); convert's by TYPES
_TYPE_NAMES = {t.value: t.name.removesuffix("_STATE_DICT").lower() for t in StateDictType}  # as stored -> TYPES
_STORED_TYPES = {name: value for value, name in _TYPE_NAMES.items()}  # TYPES -> as save_state stores it
_KEY_TYPES = {"name": OptimStateKeyType.PARAM_NAME, "id": OptimStateKeyType.PARAM_ID, None: None}


class ConversionRequestError(IncompatibleCheckpointError, ValueError):
    """What was asked cannot be made of this source: a selection that keeps nothing, or a cast of LOCAL output."""


class Selection(NamedTuple):
    """Which source entries the output holds (dotted-name prefixes), and the prefix removed from their names."""

    only: Sequence[str] = ()
    exclude: Sequence[str] = ()
    strip_prefix: str | None = None


@dataclass
class Conversion:
    """What a conversion writes, decided from the source before anything is written."""

    base: CheckpointReader  # the source as stored
    reader: CheckpointReader  # the source as the output is made of it (by parameter, or LOCAL at the new size)
    world: int
    out_type: str
    key_type: OptimStateKeyType | None  # the optimizer state rekeyed to it (None: kept as the source keys it)
    encoded_tree: Any
    outputs: list[Output]
    metadata: dict


def conversion(base: CheckpointReader, spec: ConvertSpec) -> Conversion:
    """What ``spec`` makes of the source ``base`` (pure: its tree, tensor list and manifest; nothing is read)."""
    facts = base.facts()
    metadata = dict(facts.metadata)
    stored_type = facts.state_dict_type or "full"
    source_type = "local" if is_local(base.tree()) else _TYPE_NAMES.get(stored_type, stored_type)
    # shardckpt's own checkpoints convert at the world size they were saved at; other formats (a DeepSpeed
    # checkpoint records its ranks too) to one rank, unless asked
    world = spec.world_size or (facts.world_size if facts.format == FORMAT_NAME else 1)
    asked = spec.type or ("sharded" if spec.format == "dcp" else None)  # DCP stores dim-0 chunks
    out_type = asked or ("sharded" if source_type == "full" and world > 1 else source_type)
    if out_type not in _STORED_TYPES:
        raise ConversionRequestError(f"{where(spec.src)}: its state_dict_type {stored_type!r} is none convert knows; "
                                     "pass "
                                     "type='full' or 'sharded'")
    if out_type == "local":
        if source_type != "local":
            raise no_layouts_error(where(spec.src), source_type)
        if spec.dtype is not None:
            raise ConversionRequestError("dtype: LOCAL output keeps the flat layouts' dtypes; cast with "
                                         "type='sharded' or 'full'")
        reader: CheckpointReader = LocalAtWorldSize(base, world, where(spec.src))
    else:
        reader = logical_view(base, param_names=spec.param_names)
        metadata.pop("param_names", None)  # a FULL or SHARDED output has no flat layouts to go with them
    key_type = _KEY_TYPES.get(spec.optim_key)
    key_type, rekey = _rekeying(base, reader, out_type, key_type, spec.param_names)
    selection = Selection(spec.only, spec.exclude, spec.strip_prefix)
    encoded_tree, outputs = select(reader, selection, spec.dtype, rekey)
    if key_type is not None and isinstance(encoded_tree.get("optim"), dict):
        metadata["optim_key"] = key_type.value
    if out_type == "local" and not is_local(encoded_tree):
        raise ConversionRequestError(f"only={list(selection.only)} exclude={list(selection.exclude)} strip_prefix="
                                     f"{selection.strip_prefix!r} leave out model.{LAYOUTS_KEY}: LOCAL output keeps "
                                     "the flat layouts")
    metadata["state_dict_type"] = _STORED_TYPES[out_type]
    return Conversion(base, reader, world, out_type, key_type, encoded_tree, outputs, metadata)


def _rekeying(base: CheckpointReader, reader: CheckpointReader, out_type: str, key_type: OptimStateKeyType | None,
              param_names: Sequence[str] | None) -> tuple[OptimStateKeyType | None, Callable[[dict], dict] | None]:
    """The key type the optimizer state is rekeyed to, and how (None, None: it stays as the source keys it).

    Rekeyed only when the source keys it the other way: then the output records the names its IDs stand for
    and the new key type; otherwise state and metadata stay as they are (an ID-keyed state without names keeps
    the numbering its own metadata, or torch's param-group order, gives it). IDs number FULL and SHARDED
    output's parameters as the job's FULL state dict does, and so LOCAL output's per-parameter state
    (use_orig_params); LOCAL output's flat groups as torch does (param groups' order); stored LOCAL IDs without
    recorded names follow the layouts."""
    source_optim = reader.tree().get("optim") if isinstance(reader.tree(), dict) else None
    if key_type is None or not (isinstance(source_optim, dict) and "state" in source_optim
                                and key_type_of(source_optim) not in (None, key_type)):
        return None, None
    local = out_type == "local"
    by_flat_group = local and not reader.per_parameter_optim
    return key_type, functools.partial(
        _rekeyed, key_type=key_type, id_order=None if by_flat_group else param_names or recorded_param_names(base),
        stored_order=(lambda: dict(enumerate(reader.layouts))) if local else None)


class OutputTensor:
    """A tensor leaf of the output tree (encoded as a reference by its path)."""


def _is_output_tensor(value: Any) -> bool:
    return isinstance(value, OutputTensor)


def select(reader: CheckpointReader, selection: Selection, dtype: torch.dtype | None,
           rekey: Callable[[dict], dict] | None = None) -> tuple[Any, list[Output]]:
    """The encoded output tree and its tensors, after ``only``/``exclude``, ``rekey`` (of the optimizer state),
    ``strip_prefix`` and the cast; checked as ``save`` checks a state dict (depth, unique names, plain values it
    can store) before anything is written."""
    only, exclude = selection.only, selection.exclude
    source = reader.tree()
    if not isinstance(source, dict):
        raise UnsupportedValueError(f"the source holds a {type(source).__name__} at its root; a shardckpt checkpoint "
                                    "holds a dict (save it as {'name': value} first)")
    keep, drop = wanted_keys(only or None), wanted_keys(exclude) if exclude else (lambda name: False)
    tree = pick(source, (), lambda name: keep(name) and not drop(name))
    if not tree:
        raise ConversionRequestError(f"nothing to convert: only={list(only)} exclude={list(exclude)} leave no entry of the source")
    if rekey is not None and isinstance(tree.get("optim"), dict) and "state" in tree["optim"]:
        tree["optim"] = {**tree["optim"], **rekey(tree["optim"])}
    if selection.strip_prefix:
        tree = _stripped(tree, selection.strip_prefix)
    infos = reader.tensors()
    outputs = []
    for path, leaf in leaves(tree, lambda v: isinstance(v, TensorRef)):
        if isinstance(leaf, TensorRef):
            info = infos[leaf.name]
            cast = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
            outputs.append(Output(path_name(path), path, info, cast))
    marked = replace_refs(tree, dict.fromkeys((o.source.name for o in outputs), OutputTensor()))
    check_savable_depth(marked)
    check_unique_names(_as_tensors(marked, torch.empty(0, device="meta")))
    return encode(marked, _is_output_tensor), outputs


def _stripped(tree: dict, prefix: str) -> dict:
    """``tree`` with ``prefix`` removed from the dotted names that start with it: the entries under it move up
    to the root (``{"model": {"w": t}}`` with "model." is ``{"w": t}``); other entries stay where they are."""
    kept, lifted = _split_prefix(tree, prefix, "")
    if not lifted:
        raise ConversionRequestError(f"strip_prefix {prefix!r}: no entry's name starts with it (the names start "
                                     f"with {', '.join(repr(str(k)) for k in list(tree)[:5])})")
    named = {str(k): str(k) for k in kept}  # output name -> the source name it comes from
    for name, key, value in lifted:
        if not key:
            raise ConversionRequestError(f"strip_prefix {prefix!r}: the name of {name!r} would become empty; "
                                         "strip a shorter prefix")
        if key in named:
            raise ConversionRequestError(f"strip_prefix {prefix!r}: {name!r} would be named {key!r}, as "
                                         f"{named[key]!r} is; strip a longer prefix, or leave one out with exclude")
        named[key] = name
        kept[key] = value
    return kept


def _split_prefix(node: dict, prefix: str, above: str) -> tuple[dict, list[tuple[str, str, Any]]]:
    """``node`` less its entries whose names start with ``prefix`` (a dict whose name the prefix goes through
    is split in turn), and those entries: (full name, name less the prefix, value)."""
    kept: dict = {}
    lifted: list[tuple[str, str, Any]] = []
    for key, value in node.items():
        name = str(key)
        if name.startswith(prefix):
            lifted.append((above + name, name[len(prefix):], value))
        elif prefix.startswith(name + ".") and isinstance(value, dict):
            rest, inner = _split_prefix(value, prefix[len(name) + 1:], f"{above}{name}.")
            lifted.extend(inner)
            if rest or not inner:  # a dict the prefix emptied is left out
                kept[key] = rest
        else:
            kept[key] = value
    return kept, lifted


def _rekeyed(optim: dict, key_type: OptimStateKeyType, id_order: Sequence[str] | None,
             stored_order: Callable[[], dict[int, str]] | None) -> dict:
    """The optimizer state and param groups keyed by ``key_type``: names to IDs in ``id_order`` (else the param
    groups' order), IDs to the names the groups record (else ``id_order``, else ``stored_order()``)."""
    if key_type is OptimStateKeyType.PARAM_NAME:
        return keyed_by_name(optim, id_order, stored_order, arg="param_names")
    return rekey_optim_state_dict(optim, key_type, id_order)


def _as_tensors(tree: Any, meta: torch.Tensor) -> Any:
    """The tree with the tensor ``meta`` at every tensor leaf (for the save-side name checks, which look at names
    and types only: one tensor for all, not one made per leaf)."""
    if _is_output_tensor(tree):
        return meta
    if isinstance(tree, dict):
        return {k: _as_tensors(v, meta) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_as_tensors(v, meta) for v in tree]
    return tree
