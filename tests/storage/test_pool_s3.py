"""Incremental (pooled) checkpoints on S3 (moto server on 127.0.0.1, tests/storage/conftest.py): saves reference
unchanged units in ``s3://bucket/run/shardckpt-pool/``, every step loads and verifies through its references, rm
removes one step without breaking another, and the object-store collector (``checkpoint.pool_leases``: a save's
lease, a collector's sweep marker) deletes exactly the pool files no committed checkpoint and no live save names.
Each state a kill -9 can leave (a saver's lease without its commit, after its commit; a collector's marker) is built
here step by step, and the model of every interleaving is tests/checkpoint/test_reachability.py."""
from __future__ import annotations

import json
import time

import pytest

import shardckpt
from shardckpt.checkpoint import pool_leases
from shardckpt.checkpoint.pool import pool_checkpoints, referenced_files
from shardckpt.checkpoint.pool_gc import sweep_pool
from shardckpt.checkpoint.pool_leases import SaveLease
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import CheckpointError
from shardckpt.formats.native.pool import read_pool_info
from shardckpt.io import open_storage
from tests.checkpoint.test_incremental import assert_bits, state
from tests.checkpoint.test_pool_kills import _run as run_crasher

UNIT = 64 << 10


def _save(run: str, step: int, sd: dict, options: dict, **kw) -> dict:
    sd["model"]["lora"].fill_(step)
    shardckpt.save(sd, f"{run}/step-{step}", incremental=True, incremental_unit=UNIT, storage_options=options, **kw)
    return {k: v.clone() for k, v in sd["model"].items()}


def _pool_files(run: str, options: dict) -> set[str]:
    pool = open_storage(f"{run}/shardckpt-pool", options)
    return {p for p in pool.listing("") if p.startswith("data-")}


def _named(run: str, options: dict) -> set[str]:
    """The pool files the run's committed checkpoints name, read from their manifests."""
    runs = open_storage(run, options)
    info = read_pool_info(open_storage(f"{run}/shardckpt-pool", options))
    return referenced_files([c.manifest for c in pool_checkpoints(runs, info.id)])


def _with_step_2_removed(s3_bucket) -> tuple[str, dict, dict]:
    """Steps 1-3 saved, then step 2 removed: its own (lora) files are named by no committed checkpoint."""
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {step: _save(run, step, sd, options) for step in (1, 2, 3)}
    shardckpt.rm(f"{run}/step-2", storage_options=options)
    del saved[2]
    return run, options, saved


def _named_by(run: str, step: str, options: dict) -> set[str]:
    runs = open_storage(run, options)
    info = read_pool_info(open_storage(f"{run}/shardckpt-pool", options))
    return referenced_files([c.manifest for c in pool_checkpoints(runs, info.id) if c.name == step])


def _assert_steps_load(run: str, options: dict, saved: dict) -> None:
    for step, want in saved.items():
        assert_bits(shardckpt.load_full(f"{run}/step-{step}", storage_options=options)["model"], want)
        assert verify(open_storage(f"{run}/step-{step}", options)).ok


def test_pooled_saves_load_verify_and_rm_on_s3(s3_bucket):
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {step: _save(run, step, sd, options) for step in (1, 2, 3)}
    storage = open_storage(f"{run}/shardckpt-pool", options)
    generations = storage.list_dirs("")
    assert len(generations) == 3
    assert sorted(len(storage.list_files(g)) for g in generations) == [2, 2, 4]  # later saves: lora's file only
    assert storage.list_files("leases") == []  # each save deleted its lease after its commit
    shardckpt.rm(f"{run}/step-2", storage_options=options)
    del saved[2]
    for step in (1, 3):
        report = verify(open_storage(f"{run}/step-{step}", options))
        assert report.ok and (step == 1 or report.sharing["shared_bytes"] >= sd["model"]["base"].nbytes)
    # Step 2's own lora file is named by no one now, but it is younger than 6 h: kept by default.
    assert sweep_pool(open_storage(run, options)) == []
    unnamed = _pool_files(run, options) - _named(run, options)
    assert unnamed
    listed = shardckpt.ls(run, storage_options=options).pool
    assert listed["unnamed_files"] == len(unnamed) and listed["files"] == len(_pool_files(run, options))
    assert sorted(sweep_pool(open_storage(run, options), dry_run=True, min_age_s=0)) == \
        sorted(f"shardckpt-pool/{p}" for p in unnamed)
    assert sorted(sweep_pool(open_storage(run, options), min_age_s=0)) == sorted(f"shardckpt-pool/{p}" for p in unnamed)
    assert _pool_files(run, options) == _named(run, options)
    assert storage.list_files("sweeps") == []  # the collector deleted its marker
    _assert_steps_load(run, options, saved)
    saved[4] = _save(run, 4, sd, options)
    _assert_steps_load(run, options, saved)


def test_gc_of_an_s3_run_sweeps_its_pool_with_min_age(s3_bucket):
    run, options, saved = _with_step_2_removed(s3_bucket)
    unnamed = _pool_files(run, options) - _named(run, options)
    assert unnamed
    result = shardckpt.gc(run, min_age=0, storage_options=options)
    assert {f"shardckpt-pool/{p}" for p in unnamed} <= set(result.removed)
    assert _pool_files(run, options) == _named(run, options)
    _assert_steps_load(run, options, saved)


def test_a_live_save_s_lease_protects_its_references_and_its_own_files(s3_bucket):
    run, options, saved = _with_step_2_removed(s3_bucket)
    pool = open_storage(f"{run}/shardckpt-pool", options)
    gone = _pool_files(run, options) - _named(run, options)  # step 2's own files, now named by no manifest
    assert gone
    # A save in flight (its lease names step 2's files; it has written one file of its own generation), as a kill
    # -9 after its lease would leave it, or as it is while it runs:
    pool.put_atomic("data-00000000000000aa/rank-00000-0.bin", b"x" * 10)
    lease = SaveLease(pool, "00000000000000aa", "step-4", gone)
    try:
        assert sweep_pool(open_storage(run, options), min_age_s=0) == []
        assert gone <= _pool_files(run, options)
    finally:
        lease.release()
    removed = sweep_pool(open_storage(run, options), min_age_s=0)
    assert set(removed) == {f"shardckpt-pool/{p}" for p in gone | {"data-00000000000000aa/rank-00000-0.bin"}}
    _assert_steps_load(run, options, saved)


def test_a_dead_save_s_lease_goes_when_stale_and_a_committed_one_at_once(s3_bucket, monkeypatch):
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {step: _save(run, step, sd, options) for step in (1, 2)}
    pool = open_storage(f"{run}/shardckpt-pool", options)
    manifest = json.loads(open_storage(f"{run}/step-2", options).read_bytes("manifest.json"))
    # Killed right after its commit: its lease names its own generation and target.
    pool.put_atomic(f"leases/{manifest['generation']}.json",
                    json.dumps({"target": "step-2", "generation": manifest["generation"], "files": []}).encode())
    # Killed before its commit: a lease, a file of its generation.
    pool.put_atomic("leases/00000000000000bb.json",
                    json.dumps({"target": "step-9", "generation": "00000000000000bb", "files": []}).encode())
    pool.put_atomic("data-00000000000000bb/rank-00000-0.bin", b"y" * 10)
    assert sweep_pool(open_storage(run, options), min_age_s=0) == []  # the dead save's lease is not stale yet
    assert pool.list_files("leases") == ["00000000000000bb.json"]  # the committed save's went at once
    monkeypatch.setattr(pool_leases, "LEASE_T_S", 2.0)  # T: a lease older than this is a dead save's
    time.sleep(2.1)
    assert sweep_pool(open_storage(run, options), min_age_s=0) == ["shardckpt-pool/data-00000000000000bb/rank-00000-0.bin"]
    assert pool.list_files("leases") == []
    _assert_steps_load(run, options, saved)


def test_a_save_references_nothing_a_sweep_marker_names(s3_bucket):
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {1: _save(run, 1, sd, options)}
    pool = open_storage(f"{run}/shardckpt-pool", options)
    named = _named(run, options)
    # A collector killed after publishing its marker (or one deleting now): a save must not reference those files.
    pool.put_atomic("sweeps/dead.json", json.dumps({"files": sorted(named)}).encode())
    saved[2] = _save(run, 2, sd, options)
    assert not _named_by(run, "step-2", options) & named  # everything written anew
    _assert_steps_load(run, options, saved)
    # A marker that does not parse: the save references nothing either, and a collector deletes nothing.
    pool.put_atomic("sweeps/bad.json", b"{not json")
    saved[3] = _save(run, 3, sd, options)
    step3 = json.loads(open_storage(f"{run}/step-3", options).read_bytes("manifest.json"))
    assert all(p.startswith(f"data-{step3['generation']}/") for p in _named_by(run, "step-3", options))
    with pytest.raises(CheckpointError, match="bad.json"):
        sweep_pool(open_storage(run, options), min_age_s=0)
    _assert_steps_load(run, options, saved)


def test_a_lease_that_does_not_parse_stops_the_collector(s3_bucket):
    run, options, saved = _with_step_2_removed(s3_bucket)
    before = _pool_files(run, options)
    open_storage(f"{run}/shardckpt-pool", options).put_atomic("leases/00000000000000cc.json", b'{"target": 1}')
    with pytest.raises(CheckpointError, match="not a lease"):
        sweep_pool(open_storage(run, options), min_age_s=0)
    assert _pool_files(run, options) == before
    _assert_steps_load(run, options, saved)


def test_a_save_whose_lease_was_not_renewed_in_time_commits_nothing(s3_bucket, monkeypatch):
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {1: _save(run, 1, sd, options)}
    real = SaveLease.__init__

    def late(self, *args):
        real(self, *args)
        self._renewed -= pool_leases.LEASE_T_S  # as if the save had stalled for T since its lease
    monkeypatch.setattr(SaveLease, "__init__", late)
    with pytest.raises(CheckpointError, match="lease was last renewed"):
        _save(run, 2, sd, options)
    monkeypatch.undo()
    assert not open_storage(f"{run}/step-2", options).exists("manifest.json")
    assert open_storage(f"{run}/shardckpt-pool", options).list_files("leases") == []
    _assert_steps_load(run, options, saved)


def test_a_lease_is_renewed_while_its_save_runs(s3_bucket, monkeypatch):
    server, bucket = s3_bucket
    options = server.options()
    pool = open_storage(f"s3://{bucket}/pool", options)
    monkeypatch.setattr(pool_leases, "LEASE_T_S", 2.0)  # renewed every 0.5 s
    puts = []
    real_put = pool.put_atomic

    def counted(path, data, exclusive=False):
        real_put(path, data, exclusive)
        puts.append(path)
    pool.put_atomic = counted  # each PUT of the lease: the first, then its renewals
    lease = SaveLease(pool, "00000000000000dd", "step-1", [])
    try:
        deadline = time.monotonic() + 30  # (no timing assumption: a loaded machine only delays the renewals)
        while len(puts) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert puts == ["leases/00000000000000dd.json"] * len(puts) and len(puts) >= 3  # renewed, twice at least
        assert [(x.generation, x.target) for x in pool_leases.read_leases(pool)] == [("00000000000000dd", "step-1")]
    finally:
        lease.release()
    assert pool.list_files("leases") == []


@pytest.mark.timeout(1500)
def test_kill_and_collectors_at_every_boundary_on_s3(tmp_path, s3_bucket):
    """tests/checkpoint/test_pool_kills.py's trials on S3: kill -9 at every boundary of a save, gc and rm, and a
    collector (gc; rm of the parent, then gc) at every boundary of a save, with ``min_age_s=0``: only the leases and
    markers protect. After each, every committed step loads bit for bit and verifies, before and after a gc."""
    server, bucket = s3_bucket
    s3 = json.dumps({"url": f"s3://{bucket}/t", "options": server.options()})
    found = run_crasher(tmp_path, "save,gc,rm,save_gc,save_rm_gc", "--s3", s3)
    assert found["trials"]["save"] >= 8 and found["trials"]["gc"] >= 3 and found["trials"]["rm"] >= 2
    assert found["failures"] == []


@pytest.mark.timeout(900)
def test_the_s3_trials_catch_a_saver_without_a_lease(tmp_path, s3_bucket):
    server, bucket = s3_bucket
    s3 = json.dumps({"url": f"s3://{bucket}/t", "options": server.options()})
    found = run_crasher(tmp_path, "save_rm_gc", "no_saver_lease", "--s3", s3)
    assert any("missing" in f for f in found["failures"]), found["failures"][:3]
