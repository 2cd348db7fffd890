"""Save at one world size, load at another, in real gloo processes: bit-exact for every pairing."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import shardckpt
from tests._dist import run_ranks
from tests.checkpoint.cases import check_equal, empty_like_state, reference, sharded_state

WORLD_SIZES = (1, 2, 3, 4)


def _save(path: str, rotate: int, storage_options=None) -> None:
    sd = sharded_state(dist.get_rank(), dist.get_world_size(), rotate)
    shardckpt.save(sd, path, storage_options=storage_options)


def _load_and_check(path: str, rotate: int, storage_options=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = empty_like_state(rank, world, rotate)
    shardckpt.load(sd, path, storage_options=storage_options)
    check_equal(sd, rank, world, rotate)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per save world size (rotate=0: each tensor's sharding kind fixed by position)."""
    paths = {}
    for ws in WORLD_SIZES:
        paths[ws] = str(tmp_path_factory.mktemp(f"ws{ws}") / "ckpt")
        run_ranks(ws, _save, paths[ws], 0)
    return paths


@pytest.mark.parametrize("save_ws", WORLD_SIZES)
@pytest.mark.parametrize("load_ws", WORLD_SIZES)
def test_resharding_load_is_bit_exact(saved, save_ws, load_ws):
    # rotate=1 at load: every tensor is loaded with a different sharding kind than it was saved with.
    run_ranks(load_ws, _load_and_check, saved[save_ws], 1)


def test_every_saved_checkpoint_verifies(saved):
    from shardckpt.checkpoint.verify import verify

    for path in saved.values():
        report = verify(path)
        assert report.ok, report.problems
        assert report.bytes_checked == sum(v.numel() * v.element_size() for v in reference()["model"].values())


def test_full_read_in_one_process_matches_reference(saved):
    ref = reference()
    for path in saved.values():
        full = shardckpt.load_full(path)
        for k, v in ref["model"].items():
            assert full["model"][k].dtype == v.dtype and full["model"][k].equal(v), k
        assert full["step"] == ref["step"] and full["meta"] == ref["meta"]
        only = shardckpt.load_full(path, keys=["model.tiny"])
        assert list(only) == ["model"] and list(only["model"]) == ["tiny"]


def _load_with_a_mismatch_on_rank_1(path: str) -> tuple[str, bool]:
    import torch

    sd = {"a": torch.zeros(4), "b": torch.zeros(3 if dist.get_rank() == 1 else 2)}  # b's shape is wrong on rank 1
    try:
        shardckpt.load(sd, path)
    except shardckpt.IncompatibleCheckpointError as e:
        return str(e), bool(sd["a"].eq(0).all())
    return "loaded", False


def test_a_mismatch_on_one_rank_is_refused_on_every_rank_before_any_reads(tmp_path):
    import torch

    path = str(tmp_path / "ck")
    shardckpt.save({"a": torch.ones(4), "b": torch.ones(2)}, path)
    for message, untouched in run_ranks(2, _load_with_a_mismatch_on_rank_1, path):
        assert "'b'" in message and untouched  # rank 0 read nothing either (it filled 'a' before)
