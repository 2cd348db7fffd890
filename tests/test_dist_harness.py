"""The multi-process harness itself: results, errors, collectives, timeouts."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankFailedError, RankTimeoutError, run_ranks


def _identity() -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def _fail_on_odd(marker: str) -> int:
    if dist.get_rank() % 2:
        raise ValueError(f"{marker} from rank {dist.get_rank()}")
    return dist.get_rank()


def _all_reduce_rank() -> list[float]:
    t = torch.tensor([float(dist.get_rank()), 1.0])
    dist.all_reduce(t)
    return t.tolist()


def _deadlock() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(30)


@pytest.mark.parametrize("world_size", [1, 2])
def test_results_by_rank(world_size: int) -> None:
    assert run_ranks(world_size, _identity) == [(r, world_size, 1) for r in range(world_size)]


def test_exceptions_carry_every_failing_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(4, _fail_on_odd, "boom")
    message = str(info.value)
    assert sorted(info.value.failures) == [1, 3]
    assert "boom from rank 1" in message and "boom from rank 3" in message
    assert "Traceback" in message and "_fail_on_odd" in message
    assert run_ranks(4, _identity)[3] == (3, 4, 1)


def test_all_reduce_across_three_ranks() -> None:
    assert run_ranks(3, _all_reduce_rank) == [[3.0, 3.0]] * 3


def test_timeout_kills_and_next_call_recovers() -> None:
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(2, _deadlock, timeout=3)
    assert "still running" in str(info.value) and "_deadlock" in str(info.value)
    assert run_ranks(2, _all_reduce_rank) == [[1.0, 2.0]] * 2


def _fail_on_rank_1(kind: str) -> str:
    import torch.distributed as dist

    from shardckpt.dist import attempt, raise_failures, resolve_group

    group = resolve_group()

    def work() -> None:
        if group.rank == 1:
            raise {"value": ValueError, "key": KeyError}[kind]("bad thing")

    try:
        raise_failures(group.all_gather(attempt(group.rank, work)))
    except Exception as e:  # noqa: BLE001 - the test inspects what every rank raised
        return f"{type(e).__name__}|{e}|{' '.join(getattr(e, '__notes__', []))}|{dist.get_rank()}"
    return "no error"


@pytest.mark.parametrize("kind", ["value", "key"])
def test_a_failure_keeps_its_type_on_every_rank_and_names_the_rank(kind):
    """dist.raise_failures: every rank raises the failing rank's exception as it was, noting which rank."""
    results = run_ranks(2, _fail_on_rank_1, kind)
    want = {"value": "ValueError", "key": "KeyError"}[kind]
    for r in results:
        name, message, notes, _ = r.split("|")
        assert name == want and "bad thing" in message and "raised on rank 1" in notes


def test_a_local_failure_is_raised_as_itself():
    from shardckpt.dist import attempt, raise_failures

    original = ValueError("x")

    def work() -> None:
        raise original

    with pytest.raises(ValueError) as info:
        raise_failures([attempt(0, work)])
    assert info.value is original


def _group_collectives() -> list:
    from shardckpt.dist.group import resolve_group

    group = resolve_group()
    mine = {"rank": group.rank, "data": list(range(group.rank + 3))}
    gathered = group.gather(mine)
    objs = [{"to": r} for r in range(group.world_size)] if group.is_coordinator else None
    got = group.scatter(objs)
    # rank 0 keeps its own objects, not copies (as a world of one): the others get equal copies
    own = gathered[0] is mine and got is objs[0] if group.is_coordinator else gathered is None
    return [gathered, got, own]


@pytest.mark.parametrize("world_size", [1, 3])
def test_group_gather_and_scatter(world_size: int) -> None:
    out = run_ranks(world_size, _group_collectives)
    assert out[0][0] == [{"rank": r, "data": list(range(r + 3))} for r in range(world_size)]
    assert [o[1] for o in out] == [{"to": r} for r in range(world_size)]
    assert all(o[2] for o in out)


def _abort_once_on_rank_1(marker_path: str) -> int:
    """Rank 1 dies by SIGABRT the first time (as gloo sometimes does inside torch), not the second."""
    import os
    from pathlib import Path

    if dist.get_rank() == 1 and not Path(marker_path).exists():
        Path(marker_path).touch()
        os.abort()
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return int(t.item())


def _abort_always_on_rank_1() -> None:
    import os

    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()


def test_a_rank_aborted_once_is_run_again_on_a_fresh_pool(tmp_path) -> None:
    assert run_ranks(2, _abort_once_on_rank_1, str(tmp_path / "aborted"), timeout=30) == [2, 2]
    assert (tmp_path / "aborted").exists()


def test_a_rank_that_aborts_twice_fails_the_call() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(2, _abort_always_on_rank_1, timeout=30)
    assert "rank 1 died (exit code -6)" in str(info.value)
    assert run_ranks(2, _all_reduce_rank) == [[1.0, 2.0]] * 2
