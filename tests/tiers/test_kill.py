"""The tiers' kill matrix (issue 40, item 4) with real processes: a job of 4 ranks on two simulated nodes (two
ranks each, own tier-0 directory and peer server) is killed with SIGKILL, all of its ranks as torchrun would,
then restarted. Cases: a node lost (its tier 0 deleted) with a restart at the same and at a smaller world size;
a corrupt replica on top of that; a rank killing itself mid-replication; one killing itself mid-upload to tier 2.
In every case the harness computes, from the directories before the restart, the newest step that has a whole
copy of every file on the surviving nodes or committed in tier 2; the restart must restore exactly that step,
bit for bit, and its losses must continue the uninterrupted curve."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardckpt.format.manifest import parse_manifest
from tests.tiers import _train

JOB = os.path.join(os.path.dirname(__file__), "_node_job.py")
PERSISTENT_EVERY = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(base: str, world: int, steps: int, sleep_s: float, kill: dict[int, str] | None = None) -> list:
    port, procs = _port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        env.pop("SHARDCKPT_TIERS_KILL", None)
        if kill and rank in kill:
            env["SHARDCKPT_TIERS_KILL"] = kill[rank]
        log = open(os.path.join(base, f"log-{world}-{rank}.txt"), "a")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, JOB, base, str(steps), str(sleep_s), str(PERSISTENT_EVERY)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def _run_until(procs: list, done, timeout: float = 240.0) -> None:
    """Until ``done()`` or a rank dies (then every rank is killed, as torchrun does), or all exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done() or any(p.poll() not in (None, 0) for p in procs) or all(p.poll() == 0 for p in procs):
            _kill_all(procs)
            return
        time.sleep(0.05)
    _kill_all(procs)
    raise AssertionError("the job neither reached the point nor died in time")


def _complete_steps(dirs: list[str], persistent: str, corrupt: set[tuple[int, str]] = frozenset()) -> dict[int, str]:
    """Step -> where it is whole: every file of its manifest present with its size on one of ``dirs`` (a copy in
    ``corrupt`` not counted), or its manifest committed in tier 2."""
    out = {}
    steps = {n for d in dirs if os.path.isdir(d) for n in os.listdir(d) if n.startswith("step-")}
    for name in steps:
        if _whole_in(dirs, name, corrupt):
            out[int(name[5:])] = "fast"
    if os.path.isdir(persistent):
        for name in os.listdir(persistent):
            if os.path.exists(os.path.join(persistent, name, "manifest.json")):
                out.setdefault(int(name[5:]), "tier2")
    return out


def _whole_in(dirs: list[str], name: str, corrupt: set[tuple[int, str]]) -> bool:
    """Step directory ``name`` whole across ``dirs``; False if tier 0's retention removes it while it is looked at
    (the training runs meanwhile)."""
    step = int(name[5:])
    found = [m for m in (os.path.join(d, name, "manifest.json") for d in dirs) if os.path.exists(m)]
    try:
        if not found:
            return False
        manifest = parse_manifest(open(found[0], "rb").read(), found[0])
        return all(any(os.path.exists(os.path.join(d, name, f.path)) and (step, d) not in corrupt and
                       os.path.getsize(os.path.join(d, name, f.path)) == f.size for d in dirs) for f in manifest.files)
    except FileNotFoundError:
        return False


def _tier0(base: str, node: int) -> str:
    return os.path.join(base, f"node-{node}", "run")


def _restart_and_check(base: str, world: int, expected: int) -> dict:
    procs = _launch(base, world, expected + 3, 0.0)
    for p in procs:
        assert p.wait(timeout=300) == 0, open(os.path.join(base, f"log-{world}-0.txt")).read()[-3000:]
    got = [json.load(open(os.path.join(base, f"restored-{r}.json"))) for r in range(world)]
    assert all(g["step"] == expected and g["equal"] and g["world"] == world for g in got), (expected, got)
    losses = [json.loads(line) for line in open(os.path.join(base, "losses.jsonl"))]
    after = [entry for entry in losses if entry["world"] == world and entry["step"] > expected]
    assert [e["step"] for e in after[-3:]] == [expected + 1, expected + 2, expected + 3]
    for e in after[-3:]:  # the curve continues where the restored step left it
        assert e["loss"] == pytest.approx(_train.loss_of(_train.full_at(e["step"])), rel=1e-5)
    return got[0]


def _train_then_kill(base: str, min_step: int) -> None:
    """Train on 4 ranks until tier 0 holds ``min_step`` on both nodes and tier 2 a step, then kill every rank."""
    procs = _launch(base, 4, 10_000, 0.02)

    def far_enough() -> bool:
        done = _complete_steps([_tier0(base, 0)], os.path.join(base, "persistent"))
        return any(w == "tier2" for w in done.values()) and max(done, default=0) >= min_step
    _run_until(procs, far_enough)


@pytest.mark.parametrize("world", [4, 2])
def test_node_lost_kill_9_then_restart(tmp_path, world):
    base = str(tmp_path)
    _train_then_kill(base, 7)
    shutil.rmtree(os.path.join(base, "node-1"))  # node 1 lost with its tier 0
    expected = max(_complete_steps([_tier0(base, 0)], os.path.join(base, "persistent")))
    got = _restart_and_check(base, world, expected)
    assert got["tiers"].get("tier2", 0) == 0 or expected in _complete_steps([], os.path.join(base, "persistent"))


def test_node_lost_and_a_corrupt_replica(tmp_path):
    base = str(tmp_path)
    _train_then_kill(base, 7)
    shutil.rmtree(os.path.join(base, "node-1"))
    node0 = _tier0(base, 0)
    newest = max(_complete_steps([node0], os.path.join(base, "persistent")))  # whole on node 0: its replicas
    step_dir = os.path.join(node0, f"step-{newest:09d}")
    if not os.path.exists(os.path.join(step_dir, "manifest.json")):  # whole in tier 2 only (node 0 had trimmed it)
        step_dir = os.path.join(base, "persistent", f"step-{newest:09d}")
    manifest = parse_manifest(open(os.path.join(step_dir, "manifest.json"), "rb").read(), step_dir)
    replica = next(f for f in manifest.files if "rank-00003" in f.path)  # node 1's file, a replica on node 0
    if not os.path.exists(os.path.join(step_dir, replica.path)):  # only in tier 2: flip it there
        step_dir = os.path.join(base, "persistent", f"step-{newest:09d}")
    with open(os.path.join(step_dir, replica.path), "r+b") as f:
        f.seek(replica.size // 2)
        byte = f.read(1)
        f.seek(replica.size // 2)
        f.write(bytes([byte[0] ^ 1]))
    # node 0's copies of that step no longer count; nor tier 2's, when the flipped copy was there
    complete = _complete_steps([node0], os.path.join(base, "persistent"), corrupt={(newest, node0)})
    expected = max(s for s in complete if s != newest or not step_dir.startswith(os.path.join(base, "persistent")))
    got = _restart_and_check(base, 4, expected)
    assert got["excluded"] >= 1  # the flipped copy was read, failed its checksums, and was excluded


@pytest.mark.parametrize("lane", ["replicate", "upload"])
def test_killed_mid_lane_then_restart(tmp_path, lane):
    base = str(tmp_path)
    step = 2 * PERSISTENT_EVERY  # due for tier 2 too
    procs = _launch(base, 4, 10_000, 0.02, kill={1 if lane == "upload" else 2: f"{lane}:{step}"})
    _run_until(procs, lambda: False)
    persistent = os.path.join(base, "persistent")
    if lane == "upload":  # the killed upload's step: files there, no manifest
        assert any(not os.path.exists(os.path.join(persistent, n, "manifest.json")) for n in os.listdir(persistent))
    expected = max(_complete_steps([_tier0(base, 0), _tier0(base, 1)], persistent))
    assert expected >= step
    _restart_and_check(base, 4, expected)
    if expected % PERSISTENT_EVERY == 0:  # due in tier 2: committed there now, re-driven if the kill stopped it
        assert os.path.exists(os.path.join(persistent, f"step-{expected:09d}", "manifest.json"))
    debris = [n for d, _, names in os.walk(os.path.join(base, "node-1")) for n in names if ".part-" in n]
    assert not debris
