"""Param groups across a save and a load: which saved group each of an optimizer's groups is, by the names of its
parameters, and the hyper-parameters it takes from it."""
from __future__ import annotations

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.runtime.build import FLAT_PARAM_NAMES
from shardckpt.format.param_ids import NOT_HYPER, hyper_parameters


def match_param_groups(given_groups: list[dict], optim: torch.optim.Optimizer,
                       names_of_param: list[list[str]]) -> list[dict]:
    """Hyper-parameters for each of the optimizer's param groups, from saved groups that list member names.

    ``names_of_param[i]``: the member names of the optimizer's i-th parameter. Every parameter of one
    optimizer group must sit in one saved group with the same hyper-parameter keys.
    """
    group_of = {name: i for i, pg in enumerate(given_groups) for name in pg.get("params", [])}
    # An empty group (a recipe's group that came out empty) takes the saved empty groups' values in order.
    empty = iter([i for i, pg in enumerate(given_groups) if not pg.get("params")])
    hyper, live_by_saved = [], {}
    for pg, start in zip(optim.param_groups, group_starts(optim)):
        names = [n for member_names in names_of_param[start:start + len(pg["params"])] for n in member_names]
        found = {group_of.get(n) for n in names} if names else {next(empty, -1)}
        if found == {-1}:  # none saved: nothing in it to load for
            hyper.append(hyper_parameters(pg))
            continue
        if None in found or len(found) != 1:
            named = [n for n in names if group_of.get(n) is None] if None in found else names  # the ones at fault
            raise IncompatibleCheckpointError(
                f"the saved param_groups do not match this optimizer's: parameters {named[:3]}... are "
                f"{'missing from' if None in found else 'spread over several of'} its param groups"
                f"{_other_form_hint(list(group_of), names)}")
        index = found.pop()
        _check_not_split(live_by_saved.setdefault(index, []), pg, names)
        given = given_groups[index]
        if set(given) - NOT_HYPER != set(pg) - NOT_HYPER:
            raise IncompatibleCheckpointError(f"param group hyper-parameters {sorted(set(given) - NOT_HYPER)} differ "
                                              f"from this optimizer's {sorted(set(pg) - NOT_HYPER)}: a different "
                                              "kind of optimizer?")
        hyper.append(hyper_parameters(given))
    return hyper


def _check_not_split(siblings: list, pg: dict, names: list[str]) -> None:
    """This optimizer's groups that sit in one saved group must agree on their hyper-parameters: groups made to
    differ (decay / no-decay over a checkpoint of one group) would all take the saved group's values."""
    mine = hyper_parameters(pg)
    for other, other_names in siblings:
        if not _same_values(mine, other):
            raise IncompatibleCheckpointError(
                f"the saved param_groups do not match this optimizer's: its groups with {other_names[:2]}... and "
                f"{names[:2]}... have different hyper-parameters but sit in one saved group, whose values both would "
                "take; build the optimizer with the checkpoint's groups, load, then split them")
    siblings.append((mine, names))


def _same_values(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) if torch.is_tensor(a[k]) or
               torch.is_tensor(b[k]) else a[k] == b[k] for k in a)


def _other_form_hint(saved: list[str], ours: list[str]) -> str:
    """Why names may not match: LOCAL state of the flat form (flat keys) against original parameters, or back."""
    flat = [any(str(n).endswith(tuple(FLAT_PARAM_NAMES.values())) for n in names) for names in (saved, ours)]
    if flat[0] == flat[1]:
        return ""
    return (" (it is LOCAL state of a model sharded with use_orig_params=" + str(not flat[0]) + ", this optimizer's "
            "is over one sharded with use_orig_params=" + str(not flat[1]) + ": save it as SHARDED, or load it with "
            "shardckpt.load_state, which converts between the forms)")


def group_starts(optim: torch.optim.Optimizer) -> list[int]:
    """Where each param group's parameters start in the optimizer's order of all its parameters."""
    counts = [len(pg["params"]) for pg in optim.param_groups]
    return [sum(counts[:i]) for i in range(len(counts))]
