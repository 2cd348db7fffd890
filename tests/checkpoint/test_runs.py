"""Run directories (issue 35, item 7): the step-* checkpoints below a run directory are listed with their state,
and ``gc RUN_DIR`` removes what a killed save left below it (it said "removed 0 entries"), with gc's safety
rules: nothing a committed manifest names, nothing a live writer holds."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import shardckpt
from shardckpt import CheckpointError, latest_checkpoint
from shardckpt.checkpoint.gc import collect_run, gc
from shardckpt.checkpoint.runs import (
    COMMITTED, EMPTY, INCOMPLETE, RUN_DIR, UNREADABLE, WRITING, checkpoint_or_latest, list_checkpoints, run_dir_error,
)
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import CheckpointNotFoundError
from shardckpt.io import LocalStorage, open_storage, where

# Saves steps 10 and 20, then is killed (SIGKILL, at a fixed point: halfway through the first data write)
# in the save of step 30, as the demo's --crash-at kills a training job: step-000030/data-<gen>/ stays.
_RUN = textwrap.dedent("""
    import os, signal, sys, torch, shardckpt
    from shardckpt.checkpoint import writer

    run = sys.argv[1]
    for step in (10, 20):
        shardckpt.save({"model": {"w": torch.full((1000,), float(step))}, "step": step}, f"{run}/step-{step:06d}")

    def die(w, data, block, *_):
        w.write(data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    writer._write_raw = die
    shardckpt.save({"model": {"w": torch.zeros(1 << 16)}, "step": 30}, f"{run}/step-000030")
""")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> str:
    run = str(tmp_path_factory.mktemp("runs") / "example")
    proc = subprocess.run([sys.executable, "-c", _RUN, run], capture_output=True, timeout=120,
                          # through the page cache: the half it wrote stays in the file for the listing to count
                          # (past it, the killed save's bytes would still be in its write buffer)
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), SHARDCKPT_DIRECT_IO="0"))
    assert proc.returncode == -9, proc.stderr.decode()
    return run


@pytest.fixture
def run_dir(killed_run, tmp_path) -> str:
    """A fresh copy of the killed run (the tests change it)."""
    path = str(tmp_path / "example")
    shutil.copytree(killed_run, path)
    return path


def _data_dirs(path: str) -> list[str]:
    return sorted(d for d in os.listdir(path) if d.startswith("data-"))


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_lists_the_steps_with_their_state_size_and_world_size(run_dir):
    listing = list_checkpoints(run_dir)
    assert [(e.name, e.step, e.state) for e in listing.checkpoints] == [
        ("step-000010", 10, COMMITTED), ("step-000020", 20, COMMITTED), ("step-000030", 30, INCOMPLETE)]
    ten, twenty, killed = listing.checkpoints
    assert (ten.format, ten.world_size, ten.debris) == ("shardckpt", 1, [])
    data = os.path.join(run_dir, "step-000010", _data_dirs(os.path.join(run_dir, "step-000010"))[0])
    assert ten.file_bytes == sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data) if f.endswith(".bin"))
    assert killed.debris == _data_dirs(os.path.join(run_dir, "step-000030")) and len(killed.debris) == 1
    assert killed.debris_bytes == _tree_bytes(os.path.join(run_dir, "step-000030")) > 0
    assert killed.file_bytes is None and killed.world_size is None
    assert listing.latest is twenty and twenty.path == latest_checkpoint(run_dir)
    assert listing.summary().startswith("3 checkpoints below (2 committed, 1 incomplete); the latest committed is")


def test_other_formats_are_listed_and_directories_of_other_things_are_not(run_dir, tmp_path):
    shardckpt.save({"w": torch.ones(3)}, tmp_path / "src")
    from shardckpt.offline.export import export

    export(tmp_path / "src", os.path.join(run_dir, "export-20"))
    os.makedirs(os.path.join(run_dir, "logs"))
    open(os.path.join(run_dir, "logs", "train.log"), "w").write("loss 1.0\n")
    os.makedirs(os.path.join(run_dir, "step-000040"))  # a save that died before writing anything
    os.makedirs(os.path.join(run_dir, "unused"))
    shardckpt.save({"w": torch.ones(3)}, os.path.join(run_dir, "checkpoints", "step-000001"))  # a run in the run
    os.makedirs(os.path.join(run_dir, "step-000050"))
    open(os.path.join(run_dir, "step-000050", "manifest.json"), "w").write("{not a manifest")
    listing = list_checkpoints(run_dir)
    states = {e.name: (e.state, e.format) for e in listing.checkpoints}
    assert states["export-20"] == (COMMITTED, "safetensors") and states["step-000040"] == (EMPTY, None)
    assert states["step-000050"] == (UNREADABLE, None)
    assert "manifest" in next(e.detail for e in listing.checkpoints if e.name == "step-000050")
    assert "logs" not in states and "unused" not in states
    assert states["checkpoints"] == (RUN_DIR, None)
    assert next(e.detail for e in listing.checkpoints if e.name == "checkpoints") == "1 committed below"
    assert listing.latest.name == "step-000020"  # an export is not what a job resumes from


def test_a_checkpoint_directory_is_no_run_directory(run_dir):
    assert list_checkpoints(os.path.join(run_dir, "step-000010")).checkpoints == []  # its data-* are its own
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        list_checkpoints(os.path.join(run_dir, "nothing"))


def test_gc_of_the_run_directory_removes_the_killed_saves_debris_and_its_directory(run_dir):
    before = {s: _data_dirs(os.path.join(run_dir, s)) for s in ("step-000010", "step-000020")}
    killed = _data_dirs(os.path.join(run_dir, "step-000030"))[0]
    assert sorted(gc(run_dir, dry_run=True)) == ["step-000030/", f"step-000030/{killed}"]
    assert os.path.isdir(os.path.join(run_dir, "step-000030", killed))  # a dry run removes nothing
    assert sorted(gc(run_dir)) == ["step-000030/", f"step-000030/{killed}"]  # was [] ("removed 0 entries")
    assert sorted(os.listdir(run_dir)) == ["step-000010", "step-000020"]
    for step, dirs in before.items():
        assert _data_dirs(os.path.join(run_dir, step)) == dirs and verify(os.path.join(run_dir, step)).ok
    assert gc(run_dir) == []


def test_gc_of_a_run_keeps_what_a_committed_manifest_names_and_removes_a_later_killed_overwrite(run_dir):
    twenty = os.path.join(run_dir, "step-000020")
    committed = _data_dirs(twenty)
    os.makedirs(os.path.join(twenty, "data-abc123"))  # a killed overwrite's generation
    open(os.path.join(twenty, "data-abc123", "rank-00000-0.bin"), "wb").write(b"half")
    entry = next(e for e in list_checkpoints(run_dir).checkpoints if e.name == "step-000020")
    assert (entry.state, entry.debris, entry.debris_bytes) == (COMMITTED, ["data-abc123"], 4)
    assert "step-000020/data-abc123" in gc(run_dir)
    assert _data_dirs(twenty) == committed and verify(twenty).ok
    assert shardckpt.load_full(twenty)["step"] == 20


def test_a_live_saves_directory_below_a_run_is_kept(run_dir):
    live = os.path.join(run_dir, "step-000040")
    storage = open_storage(live)
    hold = storage.hold_dir("data-11ee")  # a save still writing step 40 (flock, as save.py's _write)
    try:
        entry = next(e for e in list_checkpoints(run_dir).checkpoints if e.name == "step-000040")
        assert (entry.state, entry.live, entry.debris) == (WRITING, ["data-11ee"], [])
        removed = gc(run_dir)
        assert not any(r.startswith("step-000040") for r in removed)
        assert os.path.isdir(os.path.join(live, "data-11ee"))
    finally:
        hold.release()
    assert sorted(r for r in gc(run_dir) if r.startswith("step-000040")) == ["step-000040/", "step-000040/data-11ee"]


def test_an_empty_step_directory_held_by_an_export_is_kept(run_dir):
    step = os.path.join(run_dir, "step-000040")
    killed = _data_dirs(os.path.join(run_dir, "step-000030"))[0]
    hold = open_storage(step).hold_dir("", exclusive=True)  # what an export holds while it commits
    try:
        assert gc(run_dir) == [f"step-000030/{killed}", "step-000030/"]
        assert os.path.isdir(step)
    finally:
        hold.release()
    assert gc(run_dir) == ["step-000040/"]


def test_a_child_whose_manifest_cannot_be_read_is_kept_and_the_others_collected(run_dir):
    ten = os.path.join(run_dir, "step-000010")
    os.makedirs(os.path.join(ten, "data-abc123"))
    with open(os.path.join(ten, "manifest.json"), "r+b") as f:
        f.seek(30)
        f.write(b"#")
    with pytest.warns(UserWarning, match="step-000010: kept as it is"):
        removed = collect_run(run_dir).removed
    assert len(removed) == 2 and all(r.startswith("step-000030") for r in removed)
    assert os.path.isdir(os.path.join(ten, "data-abc123"))


@pytest.mark.parametrize("writer", ["put_atomic", "open_writer"])
def test_a_writer_whose_directory_a_collector_removed_as_empty_makes_it_again(tmp_path, monkeypatch, writer):
    """The window between a writer making its directory and creating a file in it: a ``gc RUN_DIR`` there sees
    an empty step directory and removes it; the writer makes it again (it would fail with FileNotFoundError)."""
    run, made, collected = tmp_path / "run", os.makedirs, []

    def collector_after(path, *args, **kwargs) -> None:
        made(path, *args, **kwargs)
        if os.fspath(path).rstrip("/").endswith("step-000001") and not collected:
            collected.extend(collect_run(run).removed)

    storage = open_storage(str(run / "step-000001"))
    os.makedirs(run)
    monkeypatch.setattr(os, "makedirs", collector_after)
    if writer == "put_atomic":
        storage.put_atomic("manifest.json", b"{}")
    else:
        w = storage.open_writer("notes.txt")
        w.write(memoryview(b"x"))
        w.close()
    monkeypatch.undo()
    assert collected == ["step-000001/"]  # the collector did strike in the window
    assert os.listdir(run / "step-000001") == (["manifest.json"] if writer == "put_atomic" else ["notes.txt"])


def test_run_dir_error_names_the_checkpoints_below_and_the_latest(run_dir):
    error = run_dir_error(open_storage(run_dir))
    assert isinstance(error, CheckpointNotFoundError)
    text = str(error)
    assert "a run directory, not a checkpoint" in text and "step-000010, step-000020, step-000030" in text
    assert os.path.join(run_dir, "step-000020") in text and "latest=True" in text  # (the CLI says --latest)
    assert run_dir_error(open_storage(os.path.join(run_dir, "step-000010"))) is None
    assert run_dir_error(LocalStorage(run_dir)) is None  # a Storage the caller made is one checkpoint's place
    assert where(checkpoint_or_latest(open_storage(run_dir))) == os.path.join(run_dir, "step-000020")


def test_latest_of_a_run_with_nothing_committed_says_so(tmp_path):
    os.makedirs(tmp_path / "run" / "step-000010" / "data-abc123")
    with pytest.raises(CheckpointError, match=r"latest=True: 1 checkpoint below \(1 incomplete\); no shardckpt checkpoint is committed"):
        checkpoint_or_latest(open_storage(tmp_path / "run"))
    assert where(checkpoint_or_latest(open_storage(tmp_path / "run"), required=False)) == str(tmp_path / "run")


def test_gc_of_a_run_leaves_the_data_directories_of_what_is_no_checkpoint(run_dir):
    """Below a run directory, only a checkpoint's directory (named for a step, or holding a manifest) has
    debris: another project's ``data-2024/`` is not a save's to remove."""
    other = os.path.join(run_dir, "project", "data-2024")
    os.makedirs(other)
    open(os.path.join(other, "table.csv"), "w").write("a,b\n")
    assert not any(r.startswith("project") for r in gc(run_dir))
    assert os.path.exists(os.path.join(other, "table.csv"))
    assert "project" not in [e.name for e in list_checkpoints(run_dir).checkpoints]
