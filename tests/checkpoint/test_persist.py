"""``checkpoint.persist``: the one write pipeline's last step, whatever the format behind its seam. ``begin`` on the
coordinator before anyone writes, ``write`` everywhere, ``commit`` of every share on the coordinator, ``end``
everywhere whatever happened; a failure anywhere is raised on every process, as itself."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from shardckpt.checkpoint.persist import OutputWriter, persist, write_files
from shardckpt.dist.group import Failure, raise_failures, resolve_group
from tests._dist import run_ranks


class Recording(OutputWriter):
    """A format that writes nothing: it records the steps, and fails where told."""

    def __init__(self, fail: str | None = None, rank: int = 0):
        self.fail, self.rank, self.steps, self.shares = fail, rank, [], None

    def _step(self, name: str) -> None:
        self.steps.append(name)
        if self.fail == name:
            raise OSError(28, f"injected in {name} on rank {self.rank}")

    def begin(self) -> None:
        self._step("begin")

    def write(self) -> dict:
        self._step("write")
        return {"rank": self.rank}

    def commit(self, shares: list) -> None:
        self.shares = shares
        raise_failures(shares)
        self._step("commit")

    def end(self) -> None:
        self.steps.append("end")


class NoBegin(Recording):
    begin = OutputWriter.begin


def test_the_steps_in_order_and_the_share_committed():
    writer = Recording()
    persist(writer)
    assert writer.steps == ["begin", "write", "commit", "end"] and writer.shares == [{"rank": 0}]


@pytest.mark.parametrize("step, steps", [("begin", ["begin", "end"]), ("write", ["begin", "write", "end"]),
                                         ("commit", ["begin", "write", "commit", "end"])])
def test_a_failing_step_raises_itself_after_end(step, steps):
    writer = Recording(fail=step)
    with pytest.raises(OSError, match=f"injected in {step}"):
        persist(writer)
    assert writer.steps == steps
    if step == "write":
        assert isinstance(writer.shares[0], Failure)  # the commit decides what a failed share leaves


def test_a_writer_without_begin_skips_it():
    writer = NoBegin()
    persist(writer)
    assert writer.steps == ["write", "commit", "end"]


def _over_two_ranks(fail: str | None, on: int) -> tuple[list, list | None]:
    writer = Recording(fail if dist.get_rank() == on else None, dist.get_rank())
    try:
        persist(writer, resolve_group(None))
    except OSError as e:
        return writer.steps, str(e)
    return writer.steps, writer.shares


def test_over_a_group_the_coordinator_commits_every_share():
    steps = run_ranks(2, _over_two_ranks, None, 0)
    assert steps[0] == (["begin", "write", "commit", "end"], [{"rank": 0}, {"rank": 1}])
    assert steps[1] == (["write", "end"], None)


@pytest.mark.parametrize("step, on", [("write", 1), ("begin", 0)])
def test_over_a_group_a_failure_is_raised_on_every_rank(step, on):
    results = run_ranks(2, _over_two_ranks, step, on)
    assert [message for _, message in results] == [f"[Errno 28] injected in {step} on rank {on}"] * 2
    assert all(steps[-1] == "end" for steps, _ in results)
    assert all("commit" not in steps for steps, _ in results)


def test_write_files_keeps_the_order_and_runs_threads_at_once():
    running, most = [0], [0]
    lock = threading.Lock()

    def write(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return i * i

    assert write_files(range(6), write, 3) == [i * i for i in range(6)] and most[0] == 3
    assert write_files([2], write, 3) == [4] and write_files([], write, 3) == []
