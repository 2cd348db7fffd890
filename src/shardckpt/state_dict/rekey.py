"""Optimizer state keyed by parameter ID <-> keyed by parameter name (pure: no model, no collectives)."""
from __future__ import annotations

from typing import Any, Sequence

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.state_dict.types import OptimStateKeyType


def key_type_of(osd: dict) -> OptimStateKeyType | None:
    """How ``osd`` is keyed, judged by its param groups' ``params`` (None when it names no parameter)."""
    keys = [k for pg in osd.get("param_groups", []) for k in pg.get("params", [])] + list(osd.get("state", {}))
    if not keys:
        return None
    if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        return OptimStateKeyType.PARAM_ID
    if all(isinstance(k, str) for k in keys):
        return OptimStateKeyType.PARAM_NAME
    raise IncompatibleCheckpointError("optimizer state dict mixes integer IDs and names as parameter keys")


def rekey_optim_state_dict(osd: dict, key_type: OptimStateKeyType, param_names: Sequence[str]) -> dict:
    """The same optimizer state keyed by ``key_type``.

    ``param_names[i]`` is the name of parameter ID ``i``: the unsharded model's ``named_parameters()``
    order (tied parameters once). Tensors are not copied.
    """
    current = key_type_of(osd)
    if current is None or current is key_type:
        return {"state": dict(osd.get("state", {})), "param_groups": [dict(pg) for pg in osd.get("param_groups", [])]}
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = dict(enumerate(param_names))
    else:
        mapping = {name: i for i, name in enumerate(param_names)}
    def convert(key: Any) -> Any:
        if key not in mapping:
            raise IncompatibleCheckpointError(f"optimizer state names parameter {key!r}, which the model does not "
                                              f"have ({len(param_names)} parameters)")
        return mapping[key]
    return {
        "state": {convert(k): v for k, v in osd.get("state", {}).items()},
        "param_groups": [{**pg, "params": [convert(k) for k in pg.get("params", [])]}
                         for pg in osd.get("param_groups", [])],
    }
