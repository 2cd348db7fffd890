"""Optimizer state keyed by parameter ID <-> keyed by parameter name (pure: no model, no collectives)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.param_ids import PARAM_NAMES, hyper_parameters, keyed_by_id, resolve_id_names
from shardckpt.state_dict.types import OptimStateKeyType


def key_type_of(osd: dict) -> OptimStateKeyType | None:
    """How ``osd`` is keyed, judged by its param groups' ``params`` (None when it names no parameter)."""
    by_id = keyed_by_id(osd)
    return None if by_id is None else OptimStateKeyType.PARAM_ID if by_id else OptimStateKeyType.PARAM_NAME


def rekey_optim_state_dict(osd: dict, key_type: OptimStateKeyType,
                           param_names: Sequence[str] | None = None) -> dict:
    """The same optimizer state keyed by ``key_type``; tensors are not copied.

    ID -> name: ``param_names[i]`` names ID ``i``; without it, the names the state records in its param
    groups (torch's ``param_names``) are used. IDs follow the order of the optimizer that saved them, so
    with neither this raises ``IncompatibleCheckpointError`` rather than guess. Name -> ID: the name
    ``param_names[i]`` gets ID ``i``; without it, IDs follow the param groups, as torch numbers them.
    ID-keyed results record ``param_names`` in each group, so that they are self-describing.
    """
    if key_type is OptimStateKeyType.PARAM_NAME:
        return keyed_by_name(osd, param_names, arg="param_names")
    if key_type_of(osd) is not OptimStateKeyType.PARAM_NAME:
        return _copy(osd)
    groups = osd.get("param_groups", [])
    order = param_names if param_names is not None else [name for pg in groups for name in pg.get("params", [])]
    return _rekey(osd, {name: i for i, name in enumerate(order)}, record_names=True)


def keyed_by_name(osd: dict, given: Sequence[str] | None = None,
                  fallback: Callable[[], dict[int, str]] | None = None, arg: str = "optim_param_names") -> dict:
    """``osd`` keyed by parameter name; ID-keyed state is mapped by ``resolve_id_names(groups, given,
    fallback, arg)``, name-keyed state is returned as a copy."""
    if key_type_of(osd) is not OptimStateKeyType.PARAM_ID:
        return _copy(osd)
    return _rekey(osd, resolve_id_names(osd.get("param_groups", []), given, fallback, arg), record_names=False)


def _copy(osd: dict) -> dict:
    return {"state": dict(osd.get("state", {})), "param_groups": [dict(pg) for pg in osd.get("param_groups", [])]}


def _rekey(osd: dict, mapping: dict[Any, Any], record_names: bool) -> dict:
    def convert(key: Any) -> Any:
        if key not in mapping:
            raise IncompatibleCheckpointError(f"optimizer state has parameter {key!r}, which is not among the "
                                              f"{len(mapping)} parameters it can be mapped to")
        return mapping[key]

    groups = []
    for pg in osd.get("param_groups", []):
        params = list(pg.get("params", []))
        groups.append({**hyper_parameters(pg), "params": [convert(k) for k in params]})
        if record_names:
            groups[-1][PARAM_NAMES] = params
    return {"state": {convert(k): v for k, v in osd.get("state", {}).items()}, "param_groups": groups}
