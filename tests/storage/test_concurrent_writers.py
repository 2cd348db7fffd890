"""Two processes saving to one path at the same moment (issue 16, item 1; issue 12 on S3): with
``overwrite=False`` exactly one commits and the other gets ``CheckpointExistsError``; with ``overwrite=True``
the last commit wins cleanly. On local disk and on S3 (a conditional PUT of the manifest); and on S3,
readers racing overwrites see one whole version every time."""
from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

import shardckpt
from shardckpt.checkpoint.verify import verify
from shardckpt.io import open_storage

TRIALS = int(os.environ.get("SHARDCKPT_RACE_TRIALS", "10"))


def _state(who: int) -> dict:
    return {"w": torch.full((64, 1024), float(who)), "who": who}


def _racer(who: int, paths: list[str], overwrite: bool, barrier, results, options: dict | None) -> None:
    torch.set_num_threads(1)
    for path in paths:
        barrier.wait()
        try:
            shardckpt.save(_state(who), path, overwrite=overwrite, storage_options=options)
            results.put((path, who, "committed"))
        except shardckpt.CheckpointExistsError:
            results.put((path, who, "exists"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((path, who, f"{type(e).__name__}: {e}"))


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(root, storage options, a function listing a checkpoint's data-<generation> directories)."""
    if request.param == "local":
        return str(tmp_path), None, lambda path: sorted(d for d in os.listdir(path) if d.startswith("data-"))
    server, bucket = request.getfixturevalue("s3_bucket")
    fs = server.raw_fs

    def generations(path: str) -> list[str]:
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[1] for p in fs.ls(path.removeprefix("s3://"), detail=False)
                      if p.rsplit("/", 1)[1].startswith("data-"))

    return f"s3://{bucket}", server.options(), generations


def _race(root: str, overwrite: bool, options: dict | None) -> dict[str, dict[int, str]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    paths = [f"{root}/trial-{i}" for i in range(TRIALS)]
    procs = [ctx.Process(target=_racer, args=(who, paths, overwrite, barrier, results, options)) for who in (1, 2)]
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


@pytest.mark.timeout(300)
def test_of_two_writers_to_a_new_path_exactly_one_commits(where):
    root, options, generations = where
    outcomes = _race(root, overwrite=False, options=options)
    assert len(outcomes) == TRIALS
    for path, by in outcomes.items():
        assert sorted(by.values()) == ["committed", "exists"], (path, by)
        winner = next(who for who, outcome in by.items() if outcome == "committed")
        got = shardckpt.load_full(path, storage_options=options)
        assert got["who"] == winner and torch.equal(got["w"], _state(winner)["w"])
        assert verify(open_storage(path, options)).ok
        assert len(generations(path)) == 1  # the loser removed its data


@pytest.mark.timeout(300)
def test_with_overwrite_the_last_commit_wins_cleanly(where):
    root, options, _ = where
    outcomes = _race(root, overwrite=True, options=options)
    for path, by in outcomes.items():
        assert set(by.values()) == {"committed"}, (path, by)
        got = shardckpt.load_full(path, storage_options=options)
        assert got["who"] in (1, 2) and torch.equal(got["w"], _state(got["who"])["w"])
        assert verify(open_storage(path, options)).ok


@pytest.mark.timeout(300)
def test_readers_racing_overwrites_on_s3_see_one_whole_version(s3_bucket):
    server, bucket = s3_bucket
    url, options = f"s3://{bucket}/raced", server.options()
    shardckpt.save(_state(1), url, storage_options=options)
    stop, saves = threading.Event(), [0]

    def overwrite_in_a_loop() -> None:
        while not stop.is_set():
            shardckpt.save(_state(1 + saves[0] % 2), url, overwrite=True, storage_options=options)
            saves[0] += 1

    writer = threading.Thread(target=overwrite_in_a_loop)
    writer.start()
    seen = []
    try:
        while saves[0] < 10 or len(set(seen)) < 2:
            got = shardckpt.load_full(url, storage_options=options)
            assert torch.equal(got["w"], _state(got["who"])["w"]), "a mix of two versions"
            target = {"w": torch.empty(64, 1024), "who": None}
            shardckpt.load(target, url, storage_options=options)
            assert torch.equal(target["w"], _state(target["who"])["w"]), "a mix of two versions"
            seen += [got["who"], target["who"]]
    finally:
        stop.set()
        writer.join()
    print(f"\n{len(seen)} reads during {saves[0]} overwrites; versions seen: {sorted(set(seen))}")
    assert set(seen) == {1, 2}
