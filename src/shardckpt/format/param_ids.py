"""Which parameter an ID of ID-keyed optimizer state means (pure: no model, no collectives).

A checkpoint's optimizer state names parameters by ID or by name (FORMAT.md, "LOCAL checkpoints": ``optim_key``,
``param_names``); reading it by parameter, in the state-dict layer or a reader's view, starts here.

``torch.optim.Optimizer.state_dict()`` numbers parameters in the order of the optimizer's own
``param_groups``, so an ID means nothing without the optimizer that saved it. The ID -> name map comes
from, in this order: the caller (a list, ``names[i]`` naming ID ``i``); the state itself (torch's
``param_names`` in each param group, which shardckpt writes with all ID-keyed state); a fallback the
caller establishes (a live plain optimizer built the same way, matched group by group and position
by position as torch's ``load_state_dict`` does). Otherwise it refuses: an ID is never guessed.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from shardckpt.errors import IncompatibleCheckpointError

PARAM_NAMES = "param_names"
"""torch's param-group key listing the name of each of the group's ``params``."""
NOT_HYPER = frozenset({"params", PARAM_NAMES})
"""Param-group keys that name parameters rather than hold hyper-parameters."""


def _unique(mapping: dict[int, str], what: str) -> dict[int, str]:
    seen: dict[str, int] = {}
    for pid, name in mapping.items():
        if not isinstance(name, str):
            raise IncompatibleCheckpointError(f"{what} gives ID {pid!r} the name {name!r}: names must be strings")
        if seen.setdefault(name, pid) != pid:
            raise IncompatibleCheckpointError(f"{what} gives IDs {seen[name]} and {pid} the same name {name!r}")
    return mapping


def recorded_names(groups: Sequence[dict]) -> dict[int, str] | None:
    """ID -> name from the groups' ``param_names`` (None when no group records them)."""
    if not any(PARAM_NAMES in pg for pg in groups):
        return None
    out: dict[int, str] = {}
    for i, pg in enumerate(groups):
        ids, names = list(pg.get("params", [])), pg.get(PARAM_NAMES)
        if not isinstance(names, (list, tuple)) or len(names) != len(ids):
            raise IncompatibleCheckpointError(
                f"param group {i} lists {len(ids)} params but {PARAM_NAMES!r} {names!r:.80}: a state dict that "
                f"records {PARAM_NAMES!r} must name every param of every group")
        for pid, name in zip(ids, names):
            if out.setdefault(pid, name) != name:
                raise IncompatibleCheckpointError(f"param groups name ID {pid} both {out[pid]!r} and {name!r}")
    return _unique(out, f"the param groups' {PARAM_NAMES!r}")


def positional_names(groups: Sequence[dict], live: Sequence[Sequence[str]], arg: str) -> dict[int, str]:
    """torch's rule: the i-th ID listed by saved group g is the i-th parameter of live group g (whose
    names ``live[g]`` lists). The group count and sizes must agree."""
    saved = [list(pg.get("params", [])) for pg in groups]
    if [len(ids) for ids in saved] != [len(names) for names in live]:
        raise IncompatibleCheckpointError(
            f"the optimizer state is keyed by parameter ID without {PARAM_NAMES!r}, so its IDs follow the "
            f"param_groups of the optimizer that saved it; those held {[len(ids) for ids in saved]} parameters, "
            f"this optimizer's hold {[len(names) for names in live]}. Build the optimizer as it was built for "
            f"saving, or pass {arg}=[name of ID 0, name of ID 1, ...]")
    return _unique({pid: name for ids, names in zip(saved, live) for pid, name in zip(ids, names)},
                   "this optimizer's param_groups")


def unknown_ids(arg: str) -> IncompatibleCheckpointError:
    """The refusal when nothing says which parameter an ID is."""
    return IncompatibleCheckpointError(
        f"the optimizer state is keyed by parameter ID and does not record which parameter each ID is (its "
        f"param_groups have no {PARAM_NAMES!r}); torch numbers parameters in the order of the optimizer that "
        f"saved them, which cannot be known here. Pass {arg}=[name of ID 0, name of ID 1, ...] (for an "
        "optimizer built over the unsharded model's parameters(), in one group: "
        "shardckpt.state_dict.unsharded_param_names(model)), or save from an optimizer built over "
        "model.named_parameters(), whose state dict records the names")


def resolve_id_names(groups: Sequence[dict], given: Sequence[str] | None = None,
                     fallback: Callable[[], dict[int, str]] | None = None, arg: str = "optim_param_names"
                     ) -> dict[int, str]:
    """ID -> parameter name for ID-keyed state with param groups ``groups`` (see the module docstring).

    ``given`` and names the state records must agree; ``fallback`` is asked only when neither exists,
    and ``arg`` is the argument that error messages tell the caller to pass.
    """
    recorded = recorded_names(groups)
    if given is not None:
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise TypeError(f"{arg} must be a sequence of parameter names, got {type(given).__name__}")
        mapping = _unique(dict(enumerate(given)), arg)
        clash = next((pid for pid, name in (recorded or {}).items() if mapping.get(pid) != name), None)
        if clash is not None:
            raise IncompatibleCheckpointError(
                f"{arg} names ID {clash} {mapping.get(clash)!r}, but the state records {recorded[clash]!r}: "
                f"leave {arg} out, the recorded names are used")
        return mapping
    if recorded is not None:
        return recorded
    if fallback is not None:
        return fallback()
    raise unknown_ids(arg)


def keyed_by_id(osd: dict) -> bool | None:
    """Whether optimizer state ``osd`` names parameters by integer ID (True) or by name (False), judged by its
    param groups' ``params`` and its state's keys; None when it names none. A mix of both is refused."""
    keys = [k for pg in osd.get("param_groups", []) for k in pg.get("params", [])] + list(osd.get("state", {}))
    if not keys:
        return None
    if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        return True
    if all(isinstance(k, str) for k in keys):
        return False
    raise IncompatibleCheckpointError("optimizer state dict mixes integer IDs and names as parameter keys")


def hyper_parameters(pg: dict) -> dict[str, Any]:
    """A param group's hyper-parameters: everything but the parameters and their names."""
    return {k: v for k, v in pg.items() if k not in NOT_HYPER}
