"""Checks that keep optimizer state from pairing wrong data, made before anything moves.

- Every rank's optimizer must hold the same parameters in the same groups, and keep the same state for each:
  the exchanges pair pieces by position, so an optimizer built differently on one rank (one that leaves out
  the empty pieces of a ``use_orig_params`` model, say) would pair wrong pieces or wait forever.
- State that is not shaped like its parameter (``step``) is kept once per parameter: it must be the same on
  every rank, and, to load into a flat shard, the same for every member the shard holds.
"""
from __future__ import annotations

import hashlib
import pickle
import zlib
from typing import Any, Callable, Sequence

import torch

from shardckpt.dist.group import Failure, Group, attempt, raise_failures
from shardckpt.errors import IncompatibleCheckpointError

_PLAIN = (int, float, str, bool, type(None))


def fingerprint(value: Any) -> Any:
    """What two state values compare by: a tensor's dtype, shape and the CRC of its bytes (a meta or sparse one's
    dtype, shape and layout); containers element by element; a plain value itself."""
    if torch.is_tensor(value):
        if value.is_meta or value.layout != torch.strided:
            return ("tensor", str(value.dtype), tuple(value.shape), str(value.layout))
        t = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
        return ("tensor", str(t.dtype), tuple(value.shape), zlib.crc32(t.view(torch.uint8).numpy().tobytes()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((fingerprint(k), fingerprint(v)) for k, v in value.items()))
    return value if isinstance(value, _PLAIN) else (type(value).__name__, repr(value))


def same_value(a: Any, b: Any) -> bool:
    return fingerprint(a) == fingerprint(b)


def agree(group: Group, look: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """Run ``look`` on every rank and compare what it found (collective): only a digest travels unless ranks
    differ, then every rank's finding does. A rank's failure is raised on every rank. Returns (this rank's
    finding, every rank's, or None when all are the same)."""
    mine = attempt(group.rank, look)
    digest = mine if isinstance(mine, Failure) else hashlib.sha256(pickle.dumps(mine)).hexdigest()
    digests = group.all_gather(digest)
    raise_failures(digests)
    if all(d == digests[0] for d in digests):
        return mine, None
    return mine, group.all_gather(mine)


def check_same_optimizer(everyone: list[tuple[list[list[str]], list[tuple]]]) -> None:
    """Refuse, naming them, parameters or state that differ between ranks. ``everyone[r]``: rank r's (names of its
    optimizer's parameters per param group, per parameter (state keys, per-parameter keys, fingerprints of the
    other state))."""
    groups0, entries0 = everyone[0]
    for rank, (groups, entries) in enumerate(everyone):
        if groups != groups0:
            only0 = sorted({n for g in groups0 for n in g} - {n for g in groups for n in g})
            only_here = sorted({n for g in groups for n in g} - {n for g in groups0 for n in g})
            raise IncompatibleCheckpointError(
                f"the optimizers differ between ranks: rank 0's param groups hold {[len(g) for g in groups0]} "
                f"parameters, rank {rank}'s {[len(g) for g in groups]} (only on rank 0: {only0[:5]}, only on rank "
                f"{rank}: {only_here[:5]}, else the same in another order or grouping). Build every rank's optimizer "
                "over the same parameters in the same groups (with use_orig_params a rank's piece of a parameter "
                "may be empty: keep it in the optimizer)")
    names = [n for g in groups0 for n in g]
    for i, name in enumerate(names):
        for rank, (_, entries) in enumerate(everyone):
            if entries[i][:2] != entries0[i][:2]:
                raise IncompatibleCheckpointError(
                    f"the optimizer state of {name!r} differs between ranks: rank 0 keeps {entries0[i][0]} "
                    f"(shaped like the parameter: {entries0[i][1]}), rank {rank} {entries[i][0]} (shaped like it: "
                    f"{entries[i][1]}): give every rank's optimizer the same parameters, stepped the same number of "
                    "times; an optimizer whose state is not elementwise (Adafactor's factored moments) cannot keep "
                    "it per piece of a parameter: use it with the flat form")
            for key in entries0[i][2]:
                if entries[i][2][key] != entries0[i][2][key]:
                    raise IncompatibleCheckpointError(
                        f"optimizer state {key!r} of {name!r} differs between ranks (rank 0: {entries0[i][2][key]!r:.60}, "
                        f"rank {rank}: {entries[i][2][key]!r:.60}): state not shaped like its parameter is kept once "
                        "per parameter, so it must be the same on every rank (an optimizer whose state is not "
                        "elementwise cannot keep it per piece of a parameter: use it with the flat form)")


def check_members_agree(names: Sequence[str], entries: Sequence[dict | None], same: Callable[[Any, Any], bool],
                        per_member: Callable[[Any], bool]) -> bool:
    """For a flat shard holding members ``names`` whose saved state is ``entries`` (None or {}: none saved): whether
    there is state to load (False: none for any member, as an optimizer keeps none before a parameter's first
    gradient); refuse state saved for some members only, or scalars (``per_member(key)`` false) that differ
    between members (``same``): one flat shard keeps one of each."""
    held = [bool(entry) for entry in entries]
    if not any(held):
        return False
    if not all(held):
        raise IncompatibleCheckpointError(
            f"the checkpoint holds optimizer state for {[n for n, h in zip(names, held) if h][:3]} but none for "
            f"{[n for n, h in zip(names, held) if not h][:3]}, which share one flat shard here (left out of the "
            "optimizer that saved it, or without a gradient yet): build this optimizer without them, or load it "
            "into a model sharded with use_orig_params=True, whose optimizer keeps state per parameter")
    first = entries[0]
    for name, entry in zip(names[1:], entries[1:]):
        if set(entry) != set(first):
            raise IncompatibleCheckpointError(
                f"the checkpoint's optimizer state for {names[0]!r} holds {sorted(first)}, for {name!r} "
                f"{sorted(entry)}; they share one flat shard here: load it into a model sharded with "
                "use_orig_params=True")
        for key in first:
            if not per_member(key) and not same(first[key], entry[key]):
                raise IncompatibleCheckpointError(
                    f"the checkpoint's optimizer state {key!r} of {names[0]!r} differs from that of {name!r}, which "
                    "share one flat shard here and so one value of it: load it into a model sharded with "
                    "use_orig_params=True, whose optimizer keeps it per parameter")
    return True
