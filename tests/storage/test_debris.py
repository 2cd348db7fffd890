"""What interrupted saves leave behind is removed by the next save and by ``shardckpt gc`` (issue 16, item 2);
nothing committed, and nothing a live writer holds, is ever touched."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import shardckpt
from shardckpt import CheckpointError
from shardckpt.checkpoint.gc import gc
from shardckpt.checkpoint.verify import verify
from shardckpt.io import open_storage
from shardckpt.cli.main import main
from tests.storage._util import assert_tree_equal


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")


def _state(v: float) -> dict:
    return {"w": torch.full((100,), v), "v": v}


def _entries(path: str) -> set[str]:
    return {e for e in os.listdir(path) if e.startswith(("data-", "manifest.json.tmp-"))}


def _debris(path: str, generation: str = "abc123") -> str:
    d = os.path.join(path, f"data-{generation}")
    os.makedirs(d)
    with open(os.path.join(d, "rank-00000-0.bin"), "wb") as f:
        f.write(b"half a save")
    return f"data-{generation}"


_KILLED = textwrap.dedent("""
    import os, signal, sys, torch, shardckpt
    from shardckpt.checkpoint import writer

    def die(w, data, block, *_):
        w.write(data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    writer._write_raw = die
    shardckpt.save({"w": torch.zeros(1 << 16), "v": 2.0}, sys.argv[1], overwrite=True)
""")


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    path = str(tmp_path / "ckpt")
    shardckpt.save(_state(1.0), path)
    committed = _entries(path)
    proc = subprocess.run([sys.executable, "-c", _KILLED, path], capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -9
    left = _entries(path) - committed
    assert len(left) == 1 and next(iter(left)).startswith("data-")  # the killed save's generation
    assert_tree_equal(shardckpt.load_full(path), _state(1.0))
    shardckpt.save(_state(3.0), path, overwrite=True)
    assert len(_entries(path)) == 1  # the new generation only: the old one replaced, the debris gone
    assert_tree_equal(shardckpt.load_full(path), _state(3.0))


def test_a_live_writers_directory_and_temp_manifest_are_kept(tmp_path):
    path = str(tmp_path / "ckpt")
    shardckpt.save(_state(1.0), path)
    storage = open_storage(path)
    live = _debris(path, "11ee")
    hold = storage.hold_dir(live)  # another save, still writing (flock: a separate open file description)
    dead = _debris(path, "22dd")
    fresh = os.path.join(path, "manifest.json.tmp-aaaa")  # a live save's, still being written
    stale = os.path.join(path, "manifest.json.tmp-bbbb")  # a killed save's
    for name in (fresh, stale):
        open(name, "wb").write(b"{")
    writing = os.open(fresh, os.O_WRONLY)
    fcntl.flock(writing, fcntl.LOCK_SH)  # what io.local's writer holds while it writes
    assert sorted(gc(path, dry_run=True)) == sorted([dead, "manifest.json.tmp-bbbb"])
    assert os.path.exists(os.path.join(path, dead))  # a dry run removes nothing
    shardckpt.save(_state(2.0), path, overwrite=True)
    assert os.path.isdir(os.path.join(path, live)) and os.path.exists(fresh)
    assert not os.path.exists(os.path.join(path, dead)) and not os.path.exists(stale)
    hold.release()
    os.close(writing)
    assert sorted(gc(path)) == sorted([live, "manifest.json.tmp-aaaa"])
    assert verify(path).ok and shardckpt.load_full(path)["v"] == 2.0


def test_gc_command(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    shardckpt.save(_state(1.0), path)
    dead = _debris(path)
    assert main(["gc", path, "--dry-run"]) == 0
    assert f"would remove {dead}" in capsys.readouterr().out and os.path.isdir(os.path.join(path, dead))
    assert main(["gc", path]) == 0
    assert f"removed {dead}" in capsys.readouterr().out and not os.path.exists(os.path.join(path, dead))
    assert verify(path).ok


def test_gc_refuses_when_the_manifest_cannot_be_read(tmp_path):
    path = str(tmp_path / "ckpt")
    shardckpt.save(_state(1.0), path)
    dead = _debris(path)
    with open(os.path.join(path, "manifest.json"), "r+b") as f:
        f.seek(30)
        f.write(b"#")
    with pytest.raises(CheckpointError, match="manifest"):
        gc(path)
    assert len(_entries(path)) == 2 and os.path.isdir(os.path.join(path, dead))


def test_gc_keeps_a_v1_checkpoints_data_outside_data_generation(tmp_path):
    """A v1 manifest's paths need not start with ``data-<generation>/`` (FORMAT.md): gc removed its committed
    data directory as debris, and the checkpoint with it."""
    path = str(tmp_path / "v1")
    shutil.copytree(os.path.join(FIXTURES, "v1"), path)
    (old,) = [d for d in os.listdir(path) if d.startswith("data-")]
    os.rename(os.path.join(path, old), os.path.join(path, "data-0ff1ce"))
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        text = f.read().replace(f"{old}/", "data-0ff1ce/")
    with open(manifest, "w") as f:
        f.write(text)
    assert verify(path).ok
    dead = _debris(path)
    assert gc(path) == [dead]
    assert _entries(path) == {"data-0ff1ce"} and verify(path).ok


def test_object_store_debris_goes_by_age(backend):
    if backend.kind == "local":
        pytest.skip("local disk goes by locks (the tests above)")
    shardckpt.save(_state(1.0), backend.url, storage_options=backend.options)
    backend.write("data-abc123/rank-00000-0.bin", b"half a save")
    shardckpt.save(_state(2.0), backend.url, storage_options=backend.options, overwrite=True)
    assert backend.exists("data-abc123/rank-00000-0.bin")  # recent: perhaps a live writer's
    assert gc(open_storage(backend.url, backend.options), min_age_s=0) == ["data-abc123"]
    assert not backend.exists("data-abc123/rank-00000-0.bin")
    assert shardckpt.load_full(backend.url, storage_options=backend.options)["v"] == 2.0


def test_object_store_debris_with_an_upload_in_flight_is_a_live_save(backend):
    """A save's data directory whose listed files are old but where an upload is still in flight (one big file:
    listed only once complete) is in use: gc leaves it, however small ``min_age`` (adversarial review: a gc during a
    long save removed its data, and the save committed a manifest of missing files)."""
    if backend.kind != "s3":
        pytest.skip("multipart uploads: object stores")
    shardckpt.save(_state(1.0), backend.url, storage_options=backend.options)
    backend.write("data-abc123/rank-00000-0.bin", b"a finished file")
    bucket, key = backend.root.split("/", 1)
    upload = backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/data-abc123/rank-00001-0.bin")
    assert gc(open_storage(backend.url, backend.options), min_age_s=0) == []
    assert backend.exists("data-abc123/rank-00000-0.bin")
    backend.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=f"{key}/data-abc123/rank-00001-0.bin",
                       UploadId=upload["UploadId"])
    assert gc(open_storage(backend.url, backend.options), min_age_s=0) == ["data-abc123"]


def test_a_save_whose_data_was_collected_before_its_commit_fails_and_keeps_the_previous(backend, monkeypatch):
    """Files of a save removed before its commit (a collector on an object store with a min-age shorter than the
    save): the save raises, commits nothing, and the checkpoint it would have replaced still loads."""
    from shardckpt.checkpoint import commit as commit_module

    shardckpt.save(_state(1.0), backend.url, storage_options=backend.options)
    real = commit_module.check_manifest

    def collected_first(data, where):  # the commit's last check of its manifest: a collector runs first
        storage = open_storage(backend.url, backend.options)
        for gen in [d for d in storage.list_dirs() if d.startswith("data-") and d not in committed]:
            storage.remove_dir(gen)
            removed.append(gen)
        return real(data, where)

    committed, removed = set(open_storage(backend.url, backend.options).list_dirs()), []
    monkeypatch.setattr(commit_module, "check_manifest", collected_first)
    with pytest.raises(CheckpointError, match="gone before the commit"):
        shardckpt.save(_state(2.0), backend.url, storage_options=backend.options, overwrite=True)
    monkeypatch.undo()
    assert removed
    assert shardckpt.load_full(backend.url, storage_options=backend.options)["v"] == 1.0
    assert verify(open_storage(backend.url, backend.options)).ok


def test_a_temp_manifest_collected_before_its_writer_held_it_is_made_again(tmp_path, monkeypatch):
    """The window between a writer creating its temporary manifest and holding it: a collector running there
    removes the file (it looks abandoned); the writer sees its name gone and makes it again, and commits
    (a concurrent-writers CI run once failed in this window with FileNotFoundError at the rename)."""
    from shardckpt.io import local

    storage = open_storage(str(tmp_path))
    hold, collected = local._hold, []

    def collector_first(fd: int) -> None:
        if not collected:
            for name in os.listdir(tmp_path):
                if ".tmp-" in name:
                    assert storage.remove_abandoned(name, 0.0)  # nobody holds it yet: removed
                    collected.append(name)
        hold(fd)

    monkeypatch.setattr(local, "_hold", collector_first)
    storage.put_atomic("manifest.json", b"{}")
    assert collected and storage.read_bytes("manifest.json") == b"{}"
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


@pytest.mark.parametrize("writer", ["save", "async_save", "convert"])
def test_a_generation_directory_collected_before_its_writer_held_it_is_made_again(tmp_path, monkeypatch, writer):
    """The window between a writer making its generation directory and opening it to hold it: a collector
    running there removes the empty, unheld directory; the writer makes it again and commits (it failed with
    FileNotFoundError: issue 34, item 12). The collector runs inside the window, through a hook on mkdir."""
    from shardckpt.offline.convert import convert

    shardckpt.save(_state(1.0), tmp_path / "src")
    dst, made, collected = tmp_path / "dst", os.makedirs, []

    def collector_after(path, *args, **kwargs) -> None:
        made(path, *args, **kwargs)
        name = os.path.basename(os.fspath(path).rstrip("/"))
        if name.startswith("data-") and os.path.dirname(os.fspath(path).rstrip("/")) == str(dst) and not collected:
            collected.extend(gc(str(dst)))

    monkeypatch.setattr(os, "makedirs", collector_after)
    if writer == "save":
        shardckpt.save(_state(2.0), dst)
    elif writer == "async_save":
        shardckpt.async_save(_state(2.0), dst).wait()
    else:
        convert(tmp_path / "src", dst, world_size=2)
    monkeypatch.undo()
    assert len(collected) == 1 and collected[0].startswith("data-")  # the collector did strike in the window
    assert_tree_equal(shardckpt.load_full(dst), _state(1.0 if writer == "convert" else 2.0))
    assert verify(dst).ok


def test_a_directory_being_removed_as_its_writer_makes_it_again_is_made_again(tmp_path, monkeypatch):
    """A collector's rmtree of an abandoned-looking directory under way as its writer makes it again: mkdir
    says it exists, and by the check it is gone, so os.makedirs(exist_ok=True) raises FileExistsError (a
    second export failed so, at the writer matrix's boundary 17). The writer makes it again and holds it."""
    from shardckpt.io import local

    storage, made, raced = open_storage(str(tmp_path)), os.makedirs, []

    def removed_meanwhile(path, *args, **kwargs) -> None:
        if not raced:
            raced.append(path)
            raise FileExistsError(17, "File exists", path)  # mkdir's EEXIST, gone by exist_ok's isdir check
        made(path, *args, **kwargs)

    monkeypatch.setattr(local.os, "makedirs", removed_meanwhile)
    hold = storage.hold_dir(".export-tmp-x", exclusive=True)
    monkeypatch.undo()
    assert raced and os.path.isdir(tmp_path / ".export-tmp-x")
    with pytest.raises(CheckpointError, match="another live process"):
        storage.hold_dir(".export-tmp-x", exclusive=True)
    hold.release()
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(FileExistsError):  # a file in the way is no race: said, not retried forever
        storage.hold_dir("a-file")


def test_a_run_directory_is_listed_and_collected_on_every_backend(backend):
    """``shardckpt ls`` / ``gc RUN_DIR`` (issue 35, item 7) on local disk, ``memory://`` and S3: a killed save's
    step below a run directory is listed (incomplete; on object stores "being written" while it is recent)
    and collected, the committed step untouched."""
    from shardckpt.checkpoint.runs import list_checkpoints

    run, options = backend.url, backend.options
    shardckpt.save(_state(1.0), f"{run}/step-000010", storage_options=options)
    backend.write("step-000020/data-abc123/rank-00000-0.bin", b"half a save")
    listing = list_checkpoints(open_storage(run, options))
    states = [(e.name, e.state) for e in listing.checkpoints]
    killed = "incomplete" if backend.kind == "local" else "being written"  # object stores go by age
    assert states == [("step-000010", "committed"), ("step-000020", killed)]
    assert listing.latest.name == "step-000010" and listing.checkpoints[0].world_size == 1
    assert listing.checkpoints[0].file_bytes == sum(len(backend.read(f)) for f in backend.data_files()
                                                    if f.startswith("step-000010/"))
    removed = gc(open_storage(run, options), min_age_s=0)
    assert removed == ["step-000020/data-abc123"] + (["step-000020/"] if backend.kind == "local" else [])
    left = [(e.name, e.state) for e in list_checkpoints(open_storage(run, options)).checkpoints]
    # (memory:// keeps directories of its own, empty now; gc removes empty directories on local disk only)
    assert left == [("step-000010", "committed")] + ([("step-000020", "empty")] if backend.kind == "memory" else [])
    assert shardckpt.load_full(f"{run}/step-000010", storage_options=options)["v"] == 1.0
