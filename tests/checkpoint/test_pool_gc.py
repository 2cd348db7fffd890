"""Collection by reachability (issue 39): ``gc`` of a run directory removes exactly the pool files no committed
step names; ``rm`` and retention never break another step."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import BadArgumentError, CheckpointError
from tests.checkpoint.test_incremental import UNIT, assert_bits, manifest, state


def pool_files(run) -> set[str]:
    pool = os.path.join(run, "shardckpt-pool")
    return {os.path.relpath(os.path.join(d, f), pool) for d, _, fs in os.walk(pool) for f in fs} - {"pool.json"}


def saves(run, steps, **kw) -> dict:
    states = {}
    sd = state()
    for step in steps:
        sd["model"]["lora"].fill_(step)
        sd["step"] = step
        shardckpt.save(sd, os.path.join(run, f"step-{step}"), incremental=True, incremental_unit=UNIT, **kw)
        states[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
        states[step]["model"] = {k: v.clone() for k, v in sd["model"].items()}
    return states


def test_gc_removes_only_what_no_step_names(tmp_path):
    states = saves(tmp_path, (1, 2, 3))
    before = pool_files(tmp_path)
    shardckpt.rm(tmp_path / "step-2")
    removed = shardckpt.gc(tmp_path).removed
    assert removed and all(r.startswith("shardckpt-pool/data-") for r in removed)
    assert pool_files(tmp_path) == before - {r.removeprefix("shardckpt-pool/") for r in removed}
    for step in (1, 3):
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), states[step])
        assert verify(tmp_path / f"step-{step}").ok
    named = {p for s in (1, 3) for f in manifest(tmp_path / f"step-{s}").files for p in (f.path, f.index_path)}
    assert pool_files(tmp_path) == named
    assert shardckpt.gc(tmp_path).removed == ()


def test_removing_the_step_that_wrote_the_base_keeps_the_base(tmp_path):
    states = saves(tmp_path, (1, 2))
    shardckpt.rm(tmp_path / "step-1")
    shardckpt.gc(tmp_path)
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), states[2])
    sharing = verify(tmp_path / "step-2").sharing
    assert sharing["shared"][0]["written_by"] is None  # "a removed step's data"


@pytest.mark.parametrize("how", ["lost", "replaced"])
def test_a_lost_or_replaced_pool_json_never_lets_a_save_or_gc_remove_a_committed_steps_files(tmp_path, how):
    # from helper-22: the next save made a new pool (a new id) and its sweep, like gc, counted only the manifests of
    # the new id, so it deleted the files step 1's committed manifest names
    states = saves(tmp_path, (1,))
    pool_json = tmp_path / "shardckpt-pool" / "pool.json"
    old = pool_json.read_bytes()
    os.remove(pool_json)
    if how == "replaced":
        pool_json.write_text(json.dumps({**json.loads(old), "id": "0" * 32}, separators=(",", ":")))
    states.update(saves(tmp_path, (2, 3), keep_last=1))  # step 2 (of the new pool) removed by retention
    assert not (tmp_path / "step-2").exists() and (tmp_path / "step-1").exists()
    shardckpt.gc(tmp_path)
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), states[3])
    pool_json.write_bytes(old)  # step 1 loads once its pool.json is back: its files were kept
    assert_bits(shardckpt.load_full(tmp_path / "step-1"), states[1])
    assert verify(tmp_path / "step-1").ok
    shardckpt.rm(tmp_path / "step-1")  # once no manifest names them, step 1's files go
    named = {p for f in manifest(tmp_path / "step-3").files for p in (f.path, f.index_path)}
    shardckpt.gc(tmp_path)
    assert pool_files(tmp_path) == named


def test_rm_refuses_the_latest_without_force_and_a_missing_checkpoint(tmp_path):
    saves(tmp_path, (1, 2))
    with pytest.raises(CheckpointError, match="latest"):
        shardckpt.rm(tmp_path / "step-2")
    shardckpt.rm(tmp_path / "step-2", force=True)
    assert not (tmp_path / "step-2").exists()
    with pytest.raises(shardckpt.CheckpointNotFoundError):
        shardckpt.rm(tmp_path / "step-2")


def test_retention_keep_last_and_keep_every(tmp_path):
    states = saves(tmp_path, range(1, 8), keep_last=2, keep_every=3)
    left = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path) if n.startswith("step-"))
    assert left == [3, 6, 7]
    for step in left:
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), states[step])
    named = {p for s in left for f in manifest(tmp_path / f"step-{s}").files for p in (f.path, f.index_path)}
    assert pool_files(tmp_path) == named  # the save's tidy-up swept what the removed steps alone named


def test_retention_and_latest_leave_a_checkpoint_whose_name_has_no_step(tmp_path):
    sd = state()
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT)
    shardckpt.save(sd, tmp_path / "export-fp16", incremental=True, incremental_unit=UNIT)  # not step 16
    states = saves(tmp_path, (2, 3, 4), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["export-fp16", "shardckpt-pool", "step-3", "step-4"]
    assert shardckpt.latest_checkpoint(tmp_path) == str(tmp_path / "step-4")
    for step in (3, 4):
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), states[step])
    assert verify(tmp_path / "export-fp16").ok


def test_retention_needs_incremental(tmp_path):
    with pytest.raises(BadArgumentError, match="incremental"):
        shardckpt.save(state(), tmp_path / "step-1", keep_last=2)


def test_gc_leaves_a_generation_a_live_save_holds(tmp_path):
    saves(tmp_path, (1,))
    from shardckpt.io import LocalStorage

    pool = LocalStorage(str(tmp_path / "shardckpt-pool"))
    hold = pool.hold_dir("data-00000000cafe")  # an in-flight save's generation
    with open(tmp_path / "shardckpt-pool" / "data-00000000cafe" / "rank-00000-0.bin", "wb") as f:
        f.write(b"partial")
    assert shardckpt.gc(tmp_path).removed == ()
    hold.release()
    assert shardckpt.gc(tmp_path).removed == ("shardckpt-pool/data-00000000cafe/rank-00000-0.bin",)
    assert not (tmp_path / "shardckpt-pool" / "data-00000000cafe").exists()


def test_ls_shows_the_pool_and_what_gc_would_remove_from_it(tmp_path, capsys):
    saves(tmp_path, (1, 2, 3))
    files = pool_files(tmp_path)
    size = sum(os.path.getsize(tmp_path / "shardckpt-pool" / f) for f in files)
    pool = shardckpt.ls(tmp_path).pool
    assert pool == {"path": str(tmp_path / "shardckpt-pool"), "generations": 3, "files": len(files), "bytes": size,
                    "unnamed_files": 0, "unnamed_bytes": 0, "problem": None}
    shardckpt.rm(tmp_path / "step-2")
    pool = shardckpt.ls(tmp_path).pool
    doomed = shardckpt.gc(tmp_path, dry_run=True).removed
    assert pool["unnamed_files"] == len(doomed) > 0
    assert pool["unnamed_bytes"] == sum(os.path.getsize(tmp_path / d) for d in doomed)
    from shardckpt.cli.main import main

    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pool: " in out and f"in {len(doomed)} files named by no committed checkpoint" in out
    shardckpt.gc(tmp_path)
    assert shardckpt.ls(tmp_path).pool["unnamed_files"] == 0
    (tmp_path / "step-1" / "manifest.json").write_bytes(b"{damaged")
    assert shardckpt.ls(tmp_path).pool["unnamed_files"] is None  # unknown, never a guess


def test_ls_of_a_run_without_a_pool_has_none(tmp_path):
    shardckpt.save({"w": torch.ones(3)}, tmp_path / "step-1")
    assert shardckpt.ls(tmp_path).pool is None


def test_inspect_of_a_pooled_step_reads_its_indexes_in_the_pool(tmp_path, capsys):
    saves(tmp_path, (1, 2))
    info = shardckpt.inspect(tmp_path / "step-2").details
    m = manifest(tmp_path / "step-2")
    assert info["pool"] == {"path": str(tmp_path / "shardckpt-pool"), "id": m.pool["id"],
                            "generations": len({f.path.split("/")[0] for f in m.files})} and info["pool"]["generations"] == 2
    assert info["block_size"] and info["block_size"] > 0
    tensors = {t["name"]: t for t in shardckpt.inspect(tmp_path / "step-2").tensors}
    for name, t in tensors.items():  # raw: each tensor's own chunks only, not the other rows of shared files
        assert t["codecs"] == ["raw"] and t["stored_bytes"] == t["bytes"], name
    assert info["stored_bytes"] == sum(t["bytes"] for t in tensors.values())
    from shardckpt.cli.main import main

    assert main(["inspect", str(tmp_path / "step-2")]) == 0
    out = capsys.readouterr().out
    assert "pooled (incremental)" in out and "?" not in out and "per 0 B block" not in out


def test_gc_of_a_run_says_nothing_of_a_step_removed_while_it_ran(tmp_path, monkeypatch):
    import warnings

    from shardckpt.checkpoint import gc as gc_module
    from shardckpt.errors import CorruptCheckpointError

    saves(tmp_path, (1, 2, 3))
    real = gc_module.collect

    def racing(storage, *args, **kwargs):  # rm step-2 lands between the listing and the read of its manifest
        if storage.root.endswith("step-2"):
            shardckpt.rm(tmp_path / "step-2")
            raise CorruptCheckpointError(f"{storage.url('manifest.json')}: file missing or unreadable")
        return real(storage, *args, **kwargs)

    monkeypatch.setattr(gc_module, "collect", racing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardckpt.gc(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["shardckpt-pool", "step-1", "step-3"]


@pytest.mark.parametrize("damage", ["first byte", "empty"])
def test_a_manifest_damaged_at_its_first_byte_stops_the_collectors(tmp_path, damage, monkeypatch):
    from shardckpt.checkpoint import pool_gc

    monkeypatch.setattr(pool_gc, "SWEEP_EVERY", 1)  # every save's tidy-up sweeps (below: it must sweep nothing)
    states = saves(tmp_path, (1, 2, 3))
    path = tmp_path / "step-3" / "manifest.json"
    original = path.read_bytes()
    path.write_bytes(b"" if damage == "empty" else bytes([original[0] ^ 0x01]) + original[1:])
    before = pool_files(tmp_path)
    assert shardckpt.ls(tmp_path).pool["unnamed_files"] is None  # unknown, never a guess
    with pytest.raises(CheckpointError, match="step-3"):
        shardckpt.gc(tmp_path)
    sd = state()
    shardckpt.save(sd, tmp_path / "step-4", incremental=True, incremental_unit=UNIT)  # its tidy-up sweeps nothing
    assert before <= pool_files(tmp_path)
    path.write_bytes(original)
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), states[3])
    assert verify(tmp_path / "step-3").ok


def test_rm_succeeds_when_a_concurrent_gc_removed_the_emptied_directory(tmp_path, monkeypatch):
    import shutil

    from shardckpt.checkpoint import pool_gc

    saves(tmp_path, (1, 2))
    real = pool_gc.remove_file

    def then_gc(storage, path):  # gc of the run lands right after the manifest went: the directory is removed
        real(storage, path)
        shutil.rmtree(storage.url(""), ignore_errors=True)

    monkeypatch.setattr(pool_gc, "remove_file", then_gc)
    shardckpt.rm(tmp_path / "step-1")
    assert not (tmp_path / "step-1").exists() and verify(tmp_path / "step-2").ok


def test_a_damaged_pool_json_is_said_by_ls_and_verify_pool(tmp_path, capsys):
    saves(tmp_path, (1, 2))
    (tmp_path / "shardckpt-pool" / "pool.json").write_bytes(b"{damaged")
    listing = shardckpt.ls(tmp_path)
    assert [c["name"] for c in listing.checkpoints] == ["step-1", "step-2"] and "pool.json" in listing.pool["problem"]
    run = shardckpt.verify(tmp_path)
    assert not run.ok and [c["ok"] for c in run.checkpoints] == [False, False]
    assert all("pool" in p.message for p in run.problems)
    from shardckpt.cli.main import main

    assert main(["ls", str(tmp_path)]) == 0 and "is damaged" in capsys.readouterr().out


def test_inspect_leaves_unknown_only_the_tensors_of_a_damaged_index(tmp_path):
    sd = {f"t{i}": torch.zeros(4096) + i for i in range(6)}
    shardckpt.save(sd, tmp_path / "c", compress="zstd", files_per_rank=2)
    m = manifest(tmp_path / "c")
    assert len(m.files) == 2
    (tmp_path / "c" / m.files[1].index_path).write_bytes(b"{damaged")
    tensors = {t["name"]: t for t in shardckpt.inspect(tmp_path / "c").tensors}
    for name, entry in m.tensors.items():
        unknown = 1 in entry.chunks.files_used()
        assert (tensors[name]["stored_bytes"] is None) == unknown, name
    assert any(t["stored_bytes"] is not None for t in tensors.values())


def test_a_save_sweeps_where_something_may_be_unnamed_not_at_every_save(tmp_path, monkeypatch):
    """A sweep reads every manifest of the run: a save sweeps at a process's first save of the run, every
    SWEEP_EVERY saves after, and when it replaced a step (what that step alone named goes at once)."""
    from shardckpt.checkpoint import pool_gc

    monkeypatch.setattr(pool_gc, "SWEEP_EVERY", 4)
    swept = []
    real = pool_gc.sweep_pool
    monkeypatch.setattr(pool_gc, "sweep_pool", lambda run, *a, **k: swept.append(1) or real(run, *a, **k))
    saves(tmp_path, (1,))
    assert len(swept) == 1
    debris = tmp_path / "shardckpt-pool" / "data-00000000deadbeef"  # a killed save's uncommitted generation
    debris.mkdir()
    (debris / "rank-00000-0.bin").write_bytes(b"x")
    states = saves(tmp_path, (2, 3, 4))
    assert len(swept) == 1 and debris.exists()
    saves(tmp_path, (5,))  # the fourth save since the sweep
    assert len(swept) == 2 and not debris.exists()
    old_own = {f.path for f in manifest(tmp_path / "step-5").files if f.path.startswith(
        f"data-{manifest(tmp_path / 'step-5').generation}/")}
    sd = state(1)
    shardckpt.save(sd, tmp_path / "step-5", incremental=True, incremental_unit=UNIT, overwrite=True)
    assert len(swept) == 3 and old_own and not old_own & pool_files(tmp_path)
    named = {p for s in range(1, 6) for f in manifest(tmp_path / f"step-{s}").files for p in (f.path, f.index_path)}
    assert pool_files(tmp_path) == named
    assert_bits(shardckpt.load_full(tmp_path / "step-5"), sd)
    for step in (2, 3, 4):
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), states[step])


def test_a_forked_childs_first_save_of_a_run_sweeps(tmp_path):
    """The acceptance test's kills are drawn from a dry run's count of operations in a forked child: a child's first
    save sweeps as a new process's does, whatever its parent saved before."""
    from shardckpt.checkpoint import pool_gc
    from shardckpt.io import open_storage

    run = open_storage(str(tmp_path))
    assert pool_gc.sweep_due(run, False) and not pool_gc.sweep_due(run, False)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"1" if pool_gc.sweep_due(run, False) else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert not pool_gc.sweep_due(run, False) and pool_gc.sweep_due(run, True)  # the parent's count goes on
