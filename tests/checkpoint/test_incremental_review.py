"""What an adversarial review of incremental (pooled) checkpoints found: gc of the pool directory itself, a
checkpoint saved into the pool's place, a step directory that is a link, a tensor that changes while a
synchronous save writes it, and ``rm`` of the latest step through a link."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main
from shardckpt.errors import BadArgumentError


def _state(i: int) -> dict:
    return {"a": torch.arange(5000, dtype=torch.float32) + i}


def _save(path, i: int, **more) -> None:
    shardckpt.save(_state(i), str(path), incremental=True, incremental_unit=4096, **more)


def test_gc_of_the_pool_directory_is_refused_and_removes_nothing(tmp_path, capsys):
    _save(tmp_path / "step-000001", 1)
    _save(tmp_path / "step-000002", 2)
    pool = tmp_path / "shardckpt-pool"
    before = sorted(p for p, _, _ in os.walk(pool))
    with pytest.raises(BadArgumentError, match="chunk pool .* gc the run directory"):
        shardckpt.gc(str(pool))
    assert main(["gc", str(pool)]) == 2 and "gc the run directory" in capsys.readouterr().err
    assert sorted(p for p, _, _ in os.walk(pool)) == before
    for i in (1, 2):
        assert torch.equal(shardckpt.load_full(str(tmp_path / f"step-00000{i}"))["a"], _state(i)["a"])


@pytest.mark.parametrize("incremental", [True, False])
def test_no_checkpoint_is_saved_or_converted_into_the_pool_directory(tmp_path, incremental):
    _save(tmp_path / "step-000001", 1)
    with pytest.raises(BadArgumentError, match="shardckpt-pool is the run's chunk pool"):
        shardckpt.save(_state(2), str(tmp_path / "shardckpt-pool"), incremental=incremental, overwrite=True)
    with pytest.raises(BadArgumentError, match="shardckpt-pool is the run's chunk pool"):
        shardckpt.convert(str(tmp_path / "step-000001"), str(tmp_path / "shardckpt-pool"), overwrite=True)
    assert torch.equal(shardckpt.load_full(str(tmp_path / "step-000001"))["a"], _state(1)["a"])


def test_a_step_directory_that_is_a_link_keeps_its_data(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "other-disk" / "step-000002"
    elsewhere.mkdir(parents=True)
    _save(run / "step-000001", 1)
    os.symlink(elsewhere, run / "step-000002")
    _save(run / "step-000002", 2, overwrite=True)  # its own sweep must see the linked step
    assert torch.equal(shardckpt.load_full(str(run / "step-000002"))["a"], _state(2)["a"])
    assert shardckpt.latest_checkpoint(str(run)) == str(run / "step-000002")  # where a job resumes counts it too
    shardckpt.rm(str(run / "step-000001"))  # not the latest: step-000002, through its link, is
    shardckpt.gc(str(run))
    assert torch.equal(shardckpt.load_full(str(run / "step-000002"))["a"], _state(2)["a"])


@pytest.mark.parametrize("back", [False, True], ids=["changed", "changed-and-back"])
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_tensor_changed_during_a_synchronous_save_fails_it_and_poisons_nothing(tmp_path, back, compress):
    t, calls = torch.zeros(4096), []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 1:
            t.fill_(7.0)  # after the hashing, before the writing
        elif len(calls) == 2 and back:
            t.zero_()  # and back before the save ends: what was written is still not what was hashed

    with pytest.raises(shardckpt.CheckpointError, match="tensor 'w' changed while it was being saved"):
        shardckpt.save({"w": t}, str(tmp_path / "step-000001"), incremental=True, incremental_unit=4096,
                       progress=progress, compress=compress)
    assert not (tmp_path / "step-000001" / "manifest.json").exists()
    shardckpt.save({"w": torch.zeros(4096)}, str(tmp_path / "step-000002"), incremental=True, incremental_unit=4096)
    assert torch.equal(shardckpt.load_full(str(tmp_path / "step-000002"))["w"], torch.zeros(4096))


def test_rm_through_a_link_to_the_latest_step_is_refused_without_force(tmp_path, capsys):
    _save(tmp_path / "step-000001", 1)
    _save(tmp_path / "step-000002", 2)
    os.symlink(tmp_path / "step-000002", tmp_path / "latest")
    with pytest.raises(shardckpt.CheckpointError, match="latest committed checkpoint; pass force=True to remove it"):
        shardckpt.rm(str(tmp_path / "latest"))
    assert main(["rm", str(tmp_path / "latest")]) != 0
    err = capsys.readouterr().err
    assert "pass --force to remove it" in err and "(--force)" not in err
    assert (tmp_path / "step-000002" / "manifest.json").exists()


@pytest.mark.parametrize("incremental", [True, False])
def test_a_link_to_the_pool_is_refused_as_the_pool_is(tmp_path, incremental):
    _save(tmp_path / "step-000001", 1)
    os.symlink(tmp_path / "shardckpt-pool", tmp_path / "alias")
    with pytest.raises(BadArgumentError, match="shardckpt-pool is the run's chunk pool"):
        shardckpt.save(_state(2), str(tmp_path / "alias"), incremental=incremental, overwrite=True)
    with pytest.raises(BadArgumentError, match="shardckpt-pool is the run's chunk pool"):
        shardckpt.convert(str(tmp_path / "step-000001"), str(tmp_path / "alias"), overwrite=True)
    assert shardckpt.verify(str(tmp_path / "step-000001")).ok


def test_rm_of_a_linked_step_is_judged_in_the_run_it_is_named_in(tmp_path):
    run = tmp_path / "run"
    shardckpt.save(_state(1), str(run / "step-000001"))
    shardckpt.save(_state(2), str(tmp_path / "elsewhere" / "final"))
    os.symlink(tmp_path / "elsewhere" / "final", run / "step-000002")  # the run's latest, a link
    with pytest.raises(shardckpt.CheckpointError, match="latest committed checkpoint"):
        shardckpt.rm(str(run / "step-000002"))
    shardckpt.save(_state(3), str(run / "step-000003"))  # now step 2 is not the latest: removed (its target)
    shardckpt.rm(str(run / "step-000002"))
    assert not (tmp_path / "elsewhere" / "final" / "manifest.json").exists()
    assert shardckpt.verify(str(run / "step-000001")).ok and shardckpt.verify(str(run / "step-000003")).ok
