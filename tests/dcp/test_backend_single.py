"""shardckpt as DCP's storage backend in one process: what dcp.save writes through ``StorageWriter`` is a shardckpt
checkpoint (verify, load_full, diff read it, bit for bit), ``StorageReader`` gives dcp.load any format back, the
commit is exclusive with one winner, and what shardckpt cannot store fails the save, naming the key."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.dcp import StorageReader, StorageWriter
from shardckpt.errors import (
    CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError,
    UnsupportedValueError,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# DCP wraps a rank's error in its CheckpointException, a BaseException naming it (hence BaseException below).


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(5, 3, generator=g), "b": torch.arange(4.0), "scalar": torch.tensor(2.5),
                      "empty": torch.empty(0, 3), "half": torch.randn(7, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)},
            "optim": {"state": {"w": {"step": 3, "exp_avg": torch.randn(5, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
            "train_state": {"step": 7, "losses": [0.5, float("inf")], "note": None}}


def _zeroed(sd):
    if isinstance(sd, dict):
        return {k: _zeroed(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeroed(v) for v in sd]
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else sd


def _tensors_equal(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, dict):
            _tensors_equal(v, b[k])
        elif isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and torch.equal(b[k], v), k


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_dcp_save_writes_a_shardckpt_checkpoint_that_every_reader_gets_bit_for_bit(tmp_path, compress):
    path, sd = str(tmp_path / "ckpt"), _state()
    dcp.save(sd, storage_writer=StorageWriter(path, compress=compress, metadata={"job": "t"}))
    assert sorted(os.listdir(path))[-1] == "manifest.json" and not os.path.exists(os.path.join(path, ".metadata"))
    result = shardckpt.verify(path)
    assert result.ok and result.tensors == 7, result
    full = shardckpt.load_full(path)
    _tensors_equal(sd, full)
    assert full["optim"]["param_groups"] == sd["optim"]["param_groups"]  # the tuple too
    assert full["train_state"] == sd["train_state"] and full["optim"]["state"]["w"]["step"] == 3
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["metadata"] == {"job": "t"}
    target = _zeroed(sd)
    dcp.load(target, storage_reader=StorageReader(path))
    _tensors_equal(sd, target)
    assert target["train_state"] == sd["train_state"]
    # ... and shardckpt's own load into the same structure
    again = _zeroed(sd)
    shardckpt.load(again, path)
    _tensors_equal(sd, again)


def test_the_reader_gives_dcp_a_checkpoint_saved_by_shardckpt_and_one_saved_by_dcp_itself(tmp_path):
    sd = _state()
    shardckpt.save(sd, str(tmp_path / "native"))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")))
    for source in ("native", "torch"):
        target = _zeroed(sd)
        dcp.load(target, storage_reader=StorageReader(str(tmp_path / source)))
        _tensors_equal(sd, target)
        assert target["train_state"]["step"] == 7, source


def test_a_partial_region_lands_where_dcp_asks(tmp_path):
    """A target shaped like a shard (a DTensor's local view is what DCP narrows to): here a whole-tensor load of a
    narrowed, non-contiguous view (a dtype cast is refused: test_a_target_of_another_dtype_is_refused...)."""
    path = str(tmp_path / "ckpt")
    w = torch.arange(24.0).reshape(4, 6)
    dcp.save({"w": w}, storage_writer=StorageWriter(path))
    big = torch.zeros(6, 4)
    target = {"w": big.t()[:4]}  # a non-contiguous (4, 6) view
    dcp.load(target, storage_reader=StorageReader(path))
    assert torch.equal(big.t()[:4], w)


def test_an_existing_checkpoint_is_refused_unless_overwrite_and_then_replaced_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(path))
    old = [d for d in os.listdir(path) if d.startswith("data-")]
    with pytest.raises(BaseException, match="already exists") as info:
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(path))
    assert "CheckpointExistsError" in repr(info.value) or isinstance(info.value, CheckpointExistsError)
    assert [d for d in os.listdir(path) if d.startswith("data-")] == old  # nothing written
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=StorageWriter(path, overwrite=True))
    assert torch.equal(shardckpt.load_full(path)["w"], torch.full((3,), 2.0))
    assert len([d for d in os.listdir(path) if d.startswith("data-")]) == 1 and old[0] not in os.listdir(path)


class _Overtaken(StorageWriter):
    """A writer that another save overtakes between its planning and its commit."""

    def finish(self, metadata, results):
        dcp.save({"w": torch.full((3,), 9.0)}, storage_writer=StorageWriter(self.path))
        super().finish(metadata, results)


def test_of_two_saves_racing_to_one_new_path_exactly_one_commits(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(BaseException, match="another save committed a checkpoint here first"):
        dcp.save({"w": torch.ones(3)}, storage_writer=_Overtaken(path))
    assert torch.equal(shardckpt.load_full(path)["w"], torch.full((3,), 9.0))
    assert len([d for d in os.listdir(path) if d.startswith("data-")]) == 1  # the loser's data removed
    assert shardckpt.verify(path).ok


def test_a_value_shardckpt_cannot_store_fails_the_save_naming_it_and_commits_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(BaseException, match="dataloader.rank0"):
        dcp.save({"w": torch.ones(3), "dataloader": {"rank0": b"\x80pickled"}}, storage_writer=StorageWriter(path))
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_a_flipped_byte_fails_dcp_load_naming_the_tensor(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=StorageWriter(path, files_per_rank=1))
    data = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".bin")][0]
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(BaseException, match="'w'") as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=StorageReader(path))
    assert "CorruptCheckpointError" in repr(info.value) or isinstance(info.value, CorruptCheckpointError)


def test_a_key_missing_from_the_checkpoint_is_dcps_own_error(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(path))
    with pytest.raises(BaseException, match="absent"):
        dcp.load({"w": torch.zeros(3), "absent": torch.zeros(2)}, storage_reader=StorageReader(path))


def test_checkpoint_id_replaces_the_path_as_torchtitan_passes_it(tmp_path):
    """torchtitan's CheckpointManager calls dcp.save(state, storage_writer=..., checkpoint_id=step_dir)."""
    step = str(tmp_path / "step-10")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(str(tmp_path / "ignored")), checkpoint_id=step)
    assert shardckpt.verify(step).ok and not os.path.exists(tmp_path / "ignored")
    target = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=StorageReader(str(tmp_path / "ignored")), checkpoint_id=step)
    assert torch.equal(target["w"], torch.ones(3))


def test_bad_options_are_refused_at_construction():
    with pytest.raises(ValueError, match="files_per_rank"):
        StorageWriter("x", files_per_rank=0)
    with pytest.raises(BaseException, match="zstd"):
        StorageWriter("x", compress="lz4")


@pytest.mark.parametrize("metadata", [{"a": object()}, {"a": float("nan")}])
def test_metadata_that_is_not_json_is_refused_at_construction_before_anything_is_written(tmp_path, metadata):
    with pytest.raises(UnsupportedValueError, match="StorageWriter\\(metadata=...\\) must be JSON-able"):
        StorageWriter(str(tmp_path / "ckpt"), metadata=metadata)
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("key,target", [("w", torch.zeros(3, 4, dtype=torch.float64)),
                                        ("h", torch.zeros(3, dtype=torch.float32)),
                                        ("i", torch.zeros(2, dtype=torch.int32))])
def test_a_target_of_another_dtype_is_refused_naming_the_key_and_nothing_loads(tmp_path, key, target):
    """torch's FileSystemReader casts (int64 2**40 into int32 becomes 0); shardckpt's reader refuses."""
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "h": torch.arange(3.0).to(torch.bfloat16),
              "i": torch.tensor([2**40, 5]), "step": 7}, storage_writer=StorageWriter(path))
    other = "h" if key != "h" else "w"  # a tensor of the stored dtype, in the same plan
    state = {key: target, other: torch.zeros(3, dtype=torch.bfloat16) if other == "h" else torch.zeros(3, 4),
             "step": 0}
    with pytest.raises(BaseException, match=f"tensor '{key}': the checkpoint .* holds torch.") as info:
        dcp.load(state, storage_reader=StorageReader(path))
    assert "IncompatibleCheckpointError" in repr(info.value) or isinstance(info.value, IncompatibleCheckpointError)
    assert state["step"] == 0 and not target.any() and not state[other].any()  # nothing of the plan loaded


def _rank_failures(error: BaseException) -> list:
    return [v[0] if isinstance(v, tuple) else v for v in getattr(error, "failures", {}).values()]


def test_a_damaged_or_missing_manifest_is_the_ranks_shardckpt_error_inside_dcps(tmp_path):
    """torch 2.13's dcp.load catches read_metadata's error, asks again with rank=, then asserts; the reader's
    placeholder answer lets set_up_storage_reader raise the CorruptCheckpointError itself."""
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, storage_writer=StorageWriter(path))
    manifest = os.path.join(path, "manifest.json")
    with open(manifest, "rb") as f:
        data = f.read()
    assert b'"world_size":1' in data
    with open(manifest, "wb") as f:
        f.write(data.replace(b'"world_size":1', b'"world_size":2'))
    target = {"w": torch.zeros(4)}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=StorageReader(path))
    failures = _rank_failures(info.value)
    assert [type(e) for e in failures] == [CorruptCheckpointError] and "manifest.json" in str(failures[0])
    assert not target["w"].any()
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=StorageReader(str(tmp_path / "absent")))
    assert [type(e) for e in _rank_failures(info.value)] == [CheckpointNotFoundError]
    with pytest.raises(CorruptCheckpointError):  # asked directly, the error itself
        StorageReader(path).read_metadata()
