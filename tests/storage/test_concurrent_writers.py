"""Two processes saving to one path at the same moment (issue 16, item 1): with ``overwrite=False`` exactly
one commits and the other gets ``CheckpointExistsError``; with ``overwrite=True`` the last commit wins cleanly."""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import shardckpt
from shardckpt.checkpoint.verify import verify

TRIALS = int(os.environ.get("SHARDCKPT_RACE_TRIALS", "10"))


def _state(who: int) -> dict:
    return {"w": torch.full((64, 1024), float(who)), "who": who}


def _racer(who: int, paths: list[str], overwrite: bool, barrier, results) -> None:
    torch.set_num_threads(1)
    for path in paths:
        barrier.wait()
        try:
            shardckpt.save(_state(who), path, overwrite=overwrite)
            results.put((path, who, "committed"))
        except shardckpt.CheckpointExistsError:
            results.put((path, who, "exists"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((path, who, f"{type(e).__name__}: {e}"))


def _race(root: str, overwrite: bool) -> dict[str, dict[int, str]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    paths = [os.path.join(root, f"trial-{i}") for i in range(TRIALS)]
    procs = [ctx.Process(target=_racer, args=(who, paths, overwrite, barrier, results)) for who in (1, 2)]
    for p in procs:
        p.start()
    outcomes: dict[str, dict[int, str]] = {}
    for _ in range(2 * TRIALS):
        path, who, outcome = results.get(timeout=120)
        outcomes.setdefault(path, {})[who] = outcome
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return outcomes


def _generations(path: str) -> list[str]:
    return sorted(d for d in os.listdir(path) if d.startswith("data-"))


@pytest.mark.timeout(300)
def test_of_two_writers_to_a_new_path_exactly_one_commits(tmp_path):
    outcomes = _race(str(tmp_path), overwrite=False)
    for path, by in outcomes.items():
        assert sorted(by.values()) == ["committed", "exists"], (path, by)
        winner = next(who for who, outcome in by.items() if outcome == "committed")
        got = shardckpt.load_full(path)
        assert got["who"] == winner and torch.equal(got["w"], _state(winner)["w"])
        assert verify(path).ok
        assert len(_generations(path)) == 1  # the loser removed its data


@pytest.mark.timeout(300)
def test_with_overwrite_the_last_commit_wins_cleanly(tmp_path):
    outcomes = _race(str(tmp_path), overwrite=True)
    for path, by in outcomes.items():
        assert set(by.values()) == {"committed"}, (path, by)
        got = shardckpt.load_full(path)
        assert got["who"] in (1, 2) and torch.equal(got["w"], _state(got["who"])["w"])
        assert verify(path).ok
