"""What the review of the edge step (places opened once, walked with ``io.navigate``) found (helper-13)."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.errors import CheckpointError, IncompatibleCheckpointError
from shardckpt.io import open_storage
from shardckpt.io.navigate import child, parent


def test_a_buckets_root_has_no_parent_so_rm_and_pools_refuse_it():
    """``rm s3://bucket`` computed the bucket list as the run directory and removed the whole bucket; an
    incremental save at a bucket's root put its pool in another bucket named ``shardckpt-pool``."""
    pytest.importorskip("s3fs")
    bucket = open_storage("s3://bkt", {"endpoint_url": "http://127.0.0.1:9", "key": "a", "secret": "b"})
    with pytest.raises(IncompatibleCheckpointError, match="a bucket's root has no directory above it"):
        parent(bucket)
    step = child(bucket, "run/step-1")
    run, name = parent(step)
    assert (run.root, name) == ("bkt/run", "step-1") and parent(run)[0].root == "bkt"


def _run(tmp_path, steps=(1, 2)):
    for s in steps:
        shardckpt.save({"w": torch.full((4,), float(s))}, tmp_path / "run" / f"step-{s:06d}")
    return tmp_path / "run"


def test_rm_refuses_a_directory_holding_checkpoints_of_its_own(tmp_path):
    run = _run(tmp_path)
    shardckpt.save({"w": torch.zeros(2)}, run)  # the run directory is a checkpoint itself, too
    with pytest.raises(CheckpointError, match="holds checkpoints of its own below it"):
        shardckpt.rm(run)
    assert shardckpt.latest(run).latest == str(run / "step-000002")
    assert shardckpt.rm(run, force=True).removed == str(run)


def test_latest_is_one_thing_everywhere_linked_steps_counted(tmp_path):
    run = _run(tmp_path, steps=(1,))
    shardckpt.save({"w": torch.full((4,), 2.0)}, tmp_path / "other" / "step-000002")
    os.symlink(tmp_path / "other" / "step-000002", run / "step-000002")
    want = str(run / "step-000002")
    assert shardckpt.latest_checkpoint(run) == want and shardckpt.latest(run).latest == want
    assert shardckpt.ls(run).latest_path == want
    assert shardckpt.inspect(run, latest=True).path == want
    shardckpt.export(run, tmp_path / "hf", latest=True)
    assert torch.equal(shardckpt.load_full(tmp_path / "hf")["w"], torch.full((4,), 2.0))


def test_latest_takes_a_run_directory_opened_with_open_storage(tmp_path):
    run = _run(tmp_path)
    opened = open_storage(str(run))
    assert shardckpt.latest(opened).latest == str(run / "step-000002")
    assert shardckpt.latest_checkpoint(opened) == str(run / "step-000002")


def test_export_over_an_export_from_an_opened_source(tmp_path):
    run = _run(tmp_path, steps=(1,))
    src = open_storage(str(run / "step-000001"))
    shardckpt.export(src, tmp_path / "hf")
    shardckpt.export(src, tmp_path / "hf", overwrite=True)
    assert torch.equal(shardckpt.load_full(tmp_path / "hf")["w"], torch.full((4,), 1.0))


def test_rm_names_the_checkpoint_as_given(tmp_path, monkeypatch):
    _run(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert shardckpt.rm("run/step-000001").removed == "run/step-000001"
