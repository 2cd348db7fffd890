"""Trees that differ between ranks, and per-rank values, through save, async_save and load at ws 2, 3 and 4
(issue 34, defect 2: a key on one rank only committed a checkpoint no load could read, over the good one).

Every case either round-trips exactly (load at the same world size gives each rank its own values, bit for
bit; load_full gives every rank's per-rank values and the one tree) or is refused on every rank, with the
same error naming the key and the rank, before anything is written: the checkpoint saved first at the same
path (overwrite=True) stays bit for bit as it was. The cases run in few pool calls (one per world size for
both save modes, one per world size for the loads). ``python -m pytest ... -s`` prints the counts."""
from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import PerRank, ShardedTensor
from shardckpt.checkpoint.verify import verify
from shardckpt.format.tree import PerRankValues
from shardckpt.tensor_views import as_bytes
from tests._dist import run_ranks

WORLDS = (2, 3, 4)
MODES = ("save", "async_save")
_W = torch.arange(30, dtype=torch.float32).reshape(10, 3)  # "model.w", sharded by rows


def _base(rank: int, world: int) -> dict:
    return {"model": {"w": ShardedTensor.from_full(_W, rank, world), "b": torch.arange(4.0)}, "step": 5,
            "rng": PerRank(torch.arange(3) + 10 * rank)}


# Refused: a case -> (what changes on each rank, the key named, the rank named).
def _key_on_last_rank_only(sd, r, w):  # the case: per-rank RNG under a rank's own key
    if r == w - 1:
        sd[f"rng_rank{r}"] = torch.arange(5) + r


def _plain_key_on_one_rank(sd, r, w):
    if r == 1:
        sd["extra"] = 3


def _key_missing_on_last_rank(sd, r, w):
    if r == w - 1:
        del sd["step"]


def _plain_value_differs(sd, r, w):
    sd["step"] = r


def _plain_type_differs(sd, r, w):
    sd["lr"] = 1 if r == 0 else 1.0


def _negative_zero(sd, r, w):
    sd["x"] = -0.0 if r == w - 1 else 0.0


def _tensor_vs_plain(sd, r, w):
    sd["x"] = torch.zeros(2) if r == 0 else 0


def _shape_differs(sd, r, w):
    if r == w - 1:
        sd["model"]["b"] = torch.arange(5.0)


def _dtype_differs(sd, r, w):
    if r == 1:
        sd["model"]["b"] = torch.arange(4.0, dtype=torch.float64)


def _sharded_vs_plain(sd, r, w):
    if r == 1:
        sd["model"]["w"] = _W.clone()


def _nesting_differs(sd, r, w):
    sd["opt"] = {"a": {"b": 1}} if r == 0 else {"a": [1]}


def _key_type_differs(sd, r, w):
    sd["opt"] = {"state": {0 if r < w - 1 else "0": {"step": 1}}}


def _list_length_differs(sd, r, w):
    sd["hist"] = list(range(3 + (r == 1)))


def _per_rank_on_some_ranks(sd, r, w):
    if r == 1:
        sd["rng"] = torch.arange(3)


def _sharded_tensor_in_per_rank(sd, r, w):
    sd["rng"] = PerRank({"t": ShardedTensor.from_full(_W, r, w)})


def _per_rank_in_per_rank(sd, r, w):
    sd["rng"] = PerRank([PerRank(r)])


REFUSED = {
    "key_on_last_rank_only": (_key_on_last_rank_only, lambda w: f"rng_rank{w - 1}", lambda w: w - 1),
    "plain_key_on_one_rank": (_plain_key_on_one_rank, lambda w: "extra", lambda w: 1),
    "key_missing_on_last_rank": (_key_missing_on_last_rank, lambda w: "step", lambda w: w - 1),
    "plain_value_differs": (_plain_value_differs, lambda w: "step", lambda w: 1),
    "plain_type_differs": (_plain_type_differs, lambda w: "lr", lambda w: 1),
    "negative_zero": (_negative_zero, lambda w: "x", lambda w: w - 1),
    "tensor_vs_plain": (_tensor_vs_plain, lambda w: "x", lambda w: 1),
    "shape_differs": (_shape_differs, lambda w: "model.b", lambda w: w - 1),
    "dtype_differs": (_dtype_differs, lambda w: "model.b", lambda w: 1),
    "sharded_vs_plain": (_sharded_vs_plain, lambda w: "model.w", lambda w: 1),
    "nesting_differs": (_nesting_differs, lambda w: "opt.a", lambda w: 1),
    "key_type_differs": (_key_type_differs, lambda w: "opt.state.0", lambda w: w - 1),
    "list_length_differs": (_list_length_differs, lambda w: "hist.3", lambda w: 1),
    "per_rank_on_some_ranks": (_per_rank_on_some_ranks, lambda w: "rng", lambda w: 1),
    # Misuse on every rank (no rank differs): refused naming the key.
    "sharded_tensor_in_per_rank": (_sharded_tensor_in_per_rank, lambda w: "rng", lambda w: None),
    "per_rank_in_per_rank": (_per_rank_in_per_rank, lambda w: "rng", lambda w: None),
}


# Round trips: a case -> what it adds on each rank.
def _same_everywhere(sd, r, w):
    pass


def _dict_order_differs(sd, r, w):
    cfg = {"a": 1, "b": [2.5, None]}
    ids = {0: {"step": 3}, 1: {"step": 4}}  # int keys: a $dict, its pairs in order
    sd["cfg"] = cfg if r % 2 == 0 else dict(reversed(list(cfg.items())))
    sd["ids"] = ids if r % 2 == 0 else dict(reversed(list(ids.items())))


def _nan_everywhere(sd, r, w):
    sd["loss"] = float("nan")


def _per_rank_kinds_differ(sd, r, w):
    sd["state"] = PerRank(torch.zeros(r + 1) if r % 2 == 0 else {"pos": r, "t": torch.full((2,), r)})


def _per_rank_nested_in_containers(sd, r, w):
    sd["loaders"] = [PerRank({"epoch": 1, "offset": 7 * r}), {"deep": PerRank((r, str(r), [float(r)]))}]


def _per_rank_shapes_and_dtypes_differ(sd, r, w):
    dtype = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)[r]
    sd["buf"] = PerRank(torch.arange(r + 2).to(dtype))


def _per_rank_empty_and_none(sd, r, w):
    sd["none"], sd["empty"], sd["no_elements"] = PerRank(None), PerRank({}), PerRank(torch.zeros(0, 3))


ROUND_TRIPS = {
    "same_everywhere": _same_everywhere,
    "dict_order_differs": _dict_order_differs,
    "nan_everywhere": _nan_everywhere,
    "per_rank_kinds_differ": _per_rank_kinds_differ,
    "per_rank_nested_in_containers": _per_rank_nested_in_containers,
    "per_rank_shapes_and_dtypes_differ": _per_rank_shapes_and_dtypes_differ,
    "per_rank_empty_and_none": _per_rank_empty_and_none,
}


def _state(case: str, rank: int, world: int) -> dict:
    sd = _base(rank, world)
    (REFUSED[case][0] if case in REFUSED else ROUND_TRIPS[case])(sd, rank, world)
    return sd


def _save_as(mode: str, sd: dict, path: str) -> None:
    if mode == "save":
        shardckpt.save(sd, path, overwrite=True)
    else:
        shardckpt.async_save(sd, path, overwrite=True).wait()


def _snapshot(path: str) -> dict[str, str]:
    """Every file under ``path`` and the SHA-256 of its bytes."""
    out = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            out[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return out


def _blank(value):
    """A load target shaped like ``value``: zeroed tensors, None for plain values."""
    if isinstance(value, ShardedTensor):
        return ShardedTensor(torch.zeros_like(value.local), value.global_shape, value.region)
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, PerRank):
        return PerRank(_blank(value.value))
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, PerRank, ShardedTensor, dict, list))
                                                for v in value):
        return type(value)(_blank(v) for v in value)
    return None


def assert_same(got, want, where: str = "") -> None:
    """Equal values of equal types, tensors bit for bit (NaN == NaN)."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, ShardedTensor):
        assert_same(got.local, want.local, where)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(as_bytes(got.contiguous()), as_bytes(want.contiguous())), where
    elif isinstance(want, PerRank):
        assert_same(got.value, want.value, where)
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, v) in enumerate(zip(got, want)):
            assert_same(g, v, f"{where}.{i}")
    elif isinstance(want, float) and want != want:
        assert got != got, where
    else:
        assert got == want, where


def _full(case: str, world: int) -> dict:
    """What load_full gives of a case saved at ``world``: rank 0's tree, every rank's per-rank values."""
    states = [_state(case, r, world) for r in range(world)]

    def merge(values):
        first = values[0]
        if isinstance(first, PerRank):
            return PerRankValues(v.value for v in values)
        if isinstance(first, ShardedTensor):
            return _W
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) for k in first}
        if isinstance(first, (list, tuple)) and any(isinstance(v, (PerRank, dict)) for v in first):
            return type(first)(merge([v[i] for v in values]) for i in range(len(first)))
        return first

    return merge(states)


def _run_case(case: str, mode: str, path: str) -> dict:
    """One case on this rank: the previous checkpoint, the case's save, and what became of both."""
    rank, world = dist.get_rank(), dist.get_world_size()
    before = _state("same_everywhere", rank, world)
    before["step"] = 1
    _save_as(mode, before, path)
    snapshot = _snapshot(path) if rank == 0 else None
    try:
        _save_as(mode, _state(case, rank, world), path)
        outcome = {"saved": True}
    except shardckpt.CheckpointError as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    dist.barrier()
    if "error" in outcome:
        if rank == 0:
            assert _snapshot(path) == snapshot, f"{case}: the previous checkpoint changed"
            assert_same(shardckpt.load_full(path), _full("same_everywhere", world) | {"step": 1}, case)
        return outcome
    target = _blank(_state(case, rank, world))
    shardckpt.load(target, path)
    assert_same(target, _state(case, rank, world), f"{case} loaded on rank {rank}")
    if rank == 0:
        assert_same(shardckpt.load_full(path), _full(case, world), f"{case}: load_full")
        assert verify(path).ok
    return outcome


def _run_cases(root: str) -> list[tuple[str, str, dict]]:
    world = dist.get_world_size()
    return [(mode, case, _run_case(case, mode, f"{root}/ws{world}-{mode}-{case}"))
            for mode in MODES for case in [*REFUSED, *ROUND_TRIPS]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Every case in both modes at each world size: {ws: (root, per-rank outcomes)}."""
    out = {}
    for world in WORLDS:
        root = str(tmp_path_factory.mktemp(f"agree{world}"))
        out[world] = (root, run_ranks(world, _run_cases, root, timeout=600))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_each_case_round_trips_or_is_refused_on_every_rank_before_the_commit(saved, world):
    _, by_rank = saved[world]
    refused = ok = 0
    for i, (mode, case, outcome) in enumerate(by_rank[0]):
        outcomes = [r[i][2] for r in by_rank]
        assert all(o == outcome for o in outcomes), (mode, case, outcomes)  # the same on every rank
        if case in ROUND_TRIPS:
            assert outcome == {"saved": True}, (mode, case, outcome)
            ok += 1
            continue
        _, key, named = REFUSED[case]
        assert outcome.get("error") == "UnsupportedValueError", (mode, case, outcome)
        rank_named = named(world) is None or f"rank {named(world)}" in outcome["message"]
        assert repr(key(world)) in outcome["message"] and rank_named, (mode, case, outcome["message"])
        refused += 1
    print(f"\nws {world}: {ok} round trips, {refused} refusals on every rank ({len(MODES)} modes x "
          f"({len(ROUND_TRIPS)} + {len(REFUSED)} cases)), the previous checkpoint intact after each refusal")
    assert (ok, refused) == (len(MODES) * len(ROUND_TRIPS), len(MODES) * len(REFUSED))


def _load_cases(paths: dict[int, str]) -> list[tuple[int, str, dict]]:
    """Loads, at this world size, of the per-rank checkpoint each world size saved ("same_everywhere")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for saved_ws, path in paths.items():
        for case in LOAD_CASES:
            target = _blank(_state("same_everywhere", rank, world))
            target["rng"] = PerRank(torch.full((3,), -1, dtype=torch.int64))
            strict = LOAD_CASES[case](target, rank)
            try:
                shardckpt.load(target, path, strict=strict)
                outcome = {"loaded": True}
            except shardckpt.CheckpointError as e:
                outcome = {"error": type(e).__name__, "message": str(e)}
            if "loaded" in outcome:
                got = target["rng"].value
                want = torch.arange(3) + 10 * rank if rank < saved_ws else torch.full((3,), -1, dtype=torch.int64)
                assert torch.equal(got, want), (saved_ws, case, rank, got)
                assert_same(target["model"]["w"], _base(rank, world)["model"]["w"], f"{case} model.w")
            out.append((saved_ws, case, outcome))
    return out


def _as_saved(target, rank):
    return True


def _not_strict(target, rank):
    return False


def _key_missing_on_one_rank(target, rank):
    if rank == 1:
        del target["step"]
    return True


def _plain_target_for_per_rank(target, rank):
    target["rng"] = torch.zeros(3, dtype=torch.int64)
    return True


def _per_rank_target_for_a_plain_value(target, rank):
    target["step"] = PerRank(None)
    return True


LOAD_CASES = {"as_saved": _as_saved, "not_strict": _not_strict, "key_missing_on_one_rank": _key_missing_on_one_rank,
              "plain_target_for_per_rank": _plain_target_for_per_rank,
              "per_rank_target_for_a_plain_value": _per_rank_target_for_a_plain_value}


@pytest.mark.parametrize("world", WORLDS)
def test_per_rank_values_load_by_rank_at_any_world_size_or_are_refused_on_every_rank(saved, world):
    paths = {ws: f"{saved[ws][0]}/ws{ws}-save-same_everywhere" for ws in WORLDS}
    by_rank = run_ranks(world, _load_cases, paths, timeout=300)
    counts = {"loaded": 0, "refused": 0}
    for i, (saved_ws, case, outcome) in enumerate(by_rank[0]):
        assert all(r[i][2] == outcome for r in by_rank), (saved_ws, case, [r[i][2] for r in by_rank])
        expect = {
            "as_saved": None if world <= saved_ws else rf"'rng'.*saved by {saved_ws} ranks, so rank {saved_ws} ",
            "not_strict": None,
            "key_missing_on_one_rank": r"unexpected \['step'\]",
            "plain_target_for_per_rank": r"'rng': the checkpoint holds per-rank values",
            "per_rank_target_for_a_plain_value": r"'step': the checkpoint holds one value for all ranks",
        }[case]
        if expect is None:
            assert outcome == {"loaded": True}, (saved_ws, case, outcome)
        else:
            assert outcome.get("error") == "IncompatibleCheckpointError" and re.search(expect, outcome["message"]), \
                (saved_ws, case, outcome)
        counts["loaded" if expect is None else "refused"] += 1
    print(f"\nload at ws {world} of per-rank checkpoints saved at ws {list(WORLDS)}: {counts['loaded']} loaded by "
          f"rank, {counts['refused']} refused on every rank")
