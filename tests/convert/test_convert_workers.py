"""``convert --workers N``: the workers die with their parent, whenever it is killed (kill -9): as they start, while
they wait in the rendezvous, and while they write; so does the resource tracker they share with it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import shardckpt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GONE_WITHIN_S = 30  # a deadline for the poll (start-up imports take seconds on a loaded machine), not a timing


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _survivors(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("stage", ["spawned", "rendezvous", "writing"])
def test_workers_and_their_resource_tracker_die_with_a_killed_parent(tmp_path, stage):
    src, dst, marks = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "marks")
    os.mkdir(marks)
    shardckpt.save({"w": torch.randn(2000, 100), "b": torch.randn(7)}, src)
    code = ("from tests.convert._kill import parent_of_workers; "
            f"parent_of_workers({src!r}, {dst!r}, {stage!r}, {marks!r})")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        started = json.loads(parent.stdout.readline())
        pids = started["workers"] + [started["tracker"]]
        assert all(_alive(p) for p in pids), started
        if stage != "spawned":  # else killed at once: the workers are still importing
            for rank in (0, 1):
                _wait_for(os.path.join(marks, str(rank)))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _survivors(pids) == [], f"alive {GONE_WITHIN_S} s after their parent was killed ({stage})"
        if stage != "spawned":
            assert not os.path.exists(os.path.join(dst, "manifest.json"))
    finally:
        for pid in [parent.pid] + pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
