"""kill -9 in the middle of saves, and loads racing overwrites from another process (local disk).

A saver process (tests/storage/_saver.py, started with Popen) forks children that save with
overwrite=True in a loop; the test SIGKILLs them at seeded random moments and checks that the
checkpoint at the path is always one complete version, bit-exact.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import shardckpt
from shardckpt import CheckpointNotFoundError, CorruptCheckpointError
from tests.storage._saver import VERSIONS, make_state
from tests.storage._util import assert_tree_equal, zeros_like_tree

SAVER = Path(__file__).with_name("_saver.py")


class Saver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SAVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.answers: queue.Queue[str] = queue.Queue()
        self.saves: list[tuple[float, str, float]] = []  # (when, version, seconds) of every commit
        self._lock = threading.Lock()
        self.children: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.answer(timeout=180) == "ready"

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("saved "):
                _, version, seconds = line.split()
                with self._lock:
                    self.saves.append((time.monotonic(), version, float(seconds)))
            else:
                self.answers.put(line)
        self.answers.put("EOF")

    def answer(self, timeout: float = 60) -> str:
        return self.answers.get(timeout=timeout)

    def n_saves(self) -> int:
        with self._lock:
            return len(self.saves)

    def loop(self, path: Path) -> int:
        self.proc.stdin.write(f"loop {path}\n")
        kind, pid = self.answer().split()
        assert kind == "child"
        self.children.add(int(pid))
        return int(pid)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.proc.stdin.write(f"reap {pid}\n")
        kind, reaped, status = self.answer().split()
        assert kind == "reaped" and int(reaped) == pid
        assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL
        self.children.discard(pid)

    def close(self) -> None:
        for pid in list(self.children):
            try:
                self.kill(pid)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def saver():
    s = Saver()
    yield s
    s.close()


@pytest.fixture(scope="module")
def states() -> dict:
    return {v: make_state(v) for v in VERSIONS}


def _check_complete(path: Path, states: dict) -> str:
    """The checkpoint at ``path`` is one whole version, bit-exact; returns which."""
    full = shardckpt.load_full(str(path))
    version = full.get("version")
    assert version in states, version
    assert_tree_equal(full, states[version])
    return version


def _wait_saves(saver: Saver, n: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while saver.n_saves() < n:
        assert time.monotonic() < end, "the saver made no progress"
        time.sleep(0.005)


def test_kill9_mid_save_keeps_a_complete_checkpoint(saver, states, tmp_path):
    path = tmp_path / "ckpt"
    shardckpt.save(states["A"], str(path))  # the checkpoint written once before the first kill
    rng = random.Random(20261121)

    # Kill 1, after three commits, to learn how long one save takes here.
    start = saver.n_saves()
    pid = saver.loop(path)
    _wait_saves(saver, start + 3)
    saver.kill(pid)
    seconds = sorted(s for _, _, s in saver.saves[start + 1:])  # the first save in a fresh child is slower
    save_s = seconds[len(seconds) // 2]
    _check_complete(path, states)

    # Then (commits to wait for, then a fraction of a save): early kills inside the first save (staging,
    # writing the data files), kills anywhere in the first or second save, and late ones after one to
    # three commits (the manifest rename, the old generation's removal, the next save's data).
    plan = ([(0, rng.uniform(0.0, 0.15)) for _ in range(3)] + [(rng.randint(0, 1), rng.random()) for _ in range(3)]
            + [(rng.randint(1, 3), rng.random()) for _ in range(3)])
    rng.shuffle(plan)
    seen, log = set(), []
    for wait_commits, fraction in plan:
        before = saver.n_saves()
        pid = saver.loop(path)
        _wait_saves(saver, before + wait_commits)
        time.sleep(fraction * save_s)
        saver.kill(pid)
        version = _check_complete(path, states)
        seen.add(version)
        leftovers = sorted(p.name for p in path.iterdir() if p.name.startswith("manifest.json.tmp-"))
        log.append((wait_commits, round(fraction, 3), saver.n_saves() - before, version, len(leftovers)))
        for name in leftovers:  # a temporary manifest left by a kill is never taken for a checkpoint
            alone = tmp_path / f"alone-{len(log)}-{name}"
            alone.mkdir()
            shutil.copy(path / name, alone / name)
            with pytest.raises(CheckpointNotFoundError):
                shardckpt.load_full(str(alone))
    print(f"\nsave takes ~{save_s:.3f}s; kills (commits awaited, then fraction of a save; "
          f"commits before the kill, version loaded, tmp manifests left): {log}")
    assert any(commits == 0 for _, _, commits, _, _ in log), "no kill landed inside the first save"
    assert sum(commits > 0 for _, _, commits, _, _ in log) >= 3

    # The survivor is still a normal checkpoint: overwritable, and loadable in place.
    referenced = shardckpt.load_full(str(path))["version"]
    shardckpt.save(states["A"], str(path), overwrite=True)
    sd = zeros_like_tree(states["B"])
    shardckpt.load(sd, str(path))
    assert_tree_equal(sd, states["A"])
    assert referenced in seen
    current = f"data-{json.loads((path / 'manifest.json').read_bytes())['generation']}"
    orphans = sorted(p.name for p in path.iterdir() if p.name.startswith("data-") and p.name != current)
    tmps = sorted(p.name for p in path.iterdir() if ".tmp-" in p.name)
    print(f"left behind by the kills (never cleaned up): {len(orphans)} data directories, {len(tmps)} temp manifests")


def test_load_sees_old_or_new_during_concurrent_overwrites(saver, states, tmp_path):
    path = tmp_path / "ckpt"
    shardckpt.save(states["A"], str(path))
    start = saver.n_saves()
    pid = saver.loop(path)
    loads, seen = 0, set()
    try:
        end = time.monotonic() + 60
        while saver.n_saves() < start + 12 or loads < 5 or len(seen) < 2:
            assert time.monotonic() < end
            sd = zeros_like_tree(states["A"])
            sd["version"] = None
            shardckpt.load(sd, str(path))  # retries when an overwrite removed the data it was reading
            assert sd["version"] in states
            assert_tree_equal(sd, states[sd["version"]])  # tensors and plain values all of one version
            seen.add(sd["version"])
            loads += 1
    finally:
        saver.kill(pid)
    print(f"\n{loads} loads during {saver.n_saves() - start} overwrites; versions seen: {sorted(seen)}")
    assert seen == {"A", "B"}


def test_load_full_during_concurrent_overwrites_never_returns_a_mix(saver, states, tmp_path):
    """load_full, like load, retries when an overwrite removed the generation it was reading: every call
    returns one complete version."""
    path = tmp_path / "ckpt"
    shardckpt.save(states["A"], str(path))
    start = saver.n_saves()
    pid = saver.loop(path)
    errors, seen = [], set()
    try:
        end = time.monotonic() + 60
        while saver.n_saves() < start + 12 or len(seen) < 2:
            assert time.monotonic() < end
            try:
                seen.add(_check_complete(path, states))
            except CorruptCheckpointError as e:  # the old generation vanished under it, three times running
                errors.append(str(e))
    finally:
        saver.kill(pid)
    print(f"\n{len(seen)} versions seen in {saver.n_saves() - start} overwrites; {len(errors)} load_full failed")
    assert not errors, errors[:3]


class _OverwriteAfterManifestRead:
    """Wraps LocalStorage.read_bytes: right after a reader first reads manifest.json, another writer
    commits an overwrite (and removes the generation the reader is about to read). Deterministic."""

    def __init__(self, path: Path, new_state: dict):
        from shardckpt.io import LocalStorage

        self.original = LocalStorage.read_bytes
        self.path, self.new_state, self.fired, self.busy = path, new_state, 0, False

    def __call__(self, storage, rel: str) -> bytes:
        data = self.original(storage, rel)
        if rel == "manifest.json" and not self.fired and not self.busy:
            self.busy = True
            try:
                shardckpt.save(self.new_state, str(self.path), overwrite=True)
            finally:
                self.busy = False
            self.fired += 1
        return data


@pytest.fixture
def interleaved(monkeypatch, tmp_path):
    from shardckpt.io import LocalStorage
    from tests.checkpoint.cases import reference

    path = tmp_path / "ckpt"
    old, new = reference(), zeros_like_tree(reference())
    new["step"] = 99
    shardckpt.save(old, str(path))
    hook = _OverwriteAfterManifestRead(path, new)
    monkeypatch.setattr(LocalStorage, "read_bytes", lambda storage, rel: hook(storage, rel))
    return path, old, new, hook


def test_load_retries_when_an_overwrite_lands_after_it_read_the_manifest(interleaved):
    path, old, new, hook = interleaved
    sd = zeros_like_tree(old)
    sd["step"] = -1
    shardckpt.load(sd, str(path))
    assert hook.fired == 1
    assert_tree_equal(sd, new)  # the reader moved on to the new checkpoint, whole


def test_load_full_retries_when_an_overwrite_lands_after_it_read_the_manifest(interleaved):
    # Regression: load_full had no retry and raised CorruptCheckpointError ("file missing") here.
    path, old, new, hook = interleaved
    full = shardckpt.load_full(str(path))
    assert hook.fired == 1
    assert_tree_equal(full, new)
