"""``load_full`` of the formats other than shardckpt's own (``checkpoint/load_any.py``): safetensors files and
Hugging Face directories, ``torch.save`` files and torch DCP directories, bit-exact against what was written."""
from __future__ import annotations

import json
import os
import pickle
import struct
import uuid
import warnings

import fsspec
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.checkpoint import load_any
from shardckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from tests.storage._util import assert_tree_equal


def _t(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


# --- safetensors ---------------------------------------------------------------------------------------------

def _layers(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "model.embed.weight": _with_nan(_t((16, 8), torch.bfloat16, seed)),
        "model.layers.0.weight": _t((8, 8), seed=seed + 1),
        "model.layers.0.bias": _t((8,), torch.float16, seed + 2),
        "model.layers.1.weight": _t((8, 8), seed=seed + 3),
        "model.layers.1.mask": _t((8,), torch.bool, seed + 4),
        "model.step": torch.tensor(7, dtype=torch.int64),
        "lm_head.weight": _t((0, 8), seed=seed + 5),
    }


def test_a_safetensors_file(tmp_path):
    tensors = _layers()
    path = str(tmp_path / "model.safetensors")
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    assert_tree_equal(shardckpt.load_full(path), {**tensors, "__metadata__": {"format": "pt"}})
    assert_tree_equal(shardckpt.load_full(path, keys=["model.layers.1"]),
                      {k: v for k, v in tensors.items() if k.startswith("model.layers.1.")})


def test_a_safetensors_file_by_url():
    root = f"memory://shardckpt-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    tensors = _layers(3)
    try:
        fs.pipe_file(f"{root}/w.safetensors", safetensors.torch.save(tensors))
        assert_tree_equal(shardckpt.load_full(f"{root}/w.safetensors", io_threads=2), tensors)
        assert_tree_equal(shardckpt.load_full(root), tensors)  # a directory of exactly one file
    finally:
        fs.rm(root, recursive=True)


def test_a_hugging_face_directory_with_an_index(tmp_path):
    tensors = _layers()
    names = sorted(tensors)
    first, second = names[:4], names[4:]
    safetensors.torch.save_file({k: tensors[k] for k in first}, str(tmp_path / "model-00001-of-00002.safetensors"),
                                metadata={"format": "pt"})
    safetensors.torch.save_file({k: tensors[k] for k in second}, str(tmp_path / "model-00002-of-00002.safetensors"),
                                metadata={"format": "pt", "only": "here"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
         "weight_map": weight_map}))
    got = shardckpt.load_full(str(tmp_path))
    assert_tree_equal(got, {**tensors, "__metadata__": {"format": "pt"}})  # only what both files agree on
    assert_tree_equal(shardckpt.load_full(str(tmp_path), keys=["model.layers", "lm_head"]),
                      {k: v for k, v in tensors.items() if k.startswith(("model.layers.", "lm_head."))})
    assert shardckpt.load_full(str(tmp_path), keys=["model.lay"]) == {}  # whole name components only


def _hostile_safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("offsets", [[0, 8], [0, 4 << 40]])
def test_a_hostile_safetensors_header_claiming_a_huge_tensor_is_refused_before_allocating(tmp_path, offsets):
    """The reader checks every claimed size against the file's bytes: a 4 TiB tensor in 8 bytes of data is
    refused as corrupt (no allocation, no MemoryError), whether its offsets say 8 bytes or 4 TiB."""
    path = str(tmp_path / "evil.safetensors")
    _hostile_safetensors(path, {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": offsets}}, bytes(8))
    with pytest.raises(CorruptCheckpointError, match="evil.safetensors: tensor 'w'"):
        shardckpt.load_full(path)


# --- torch.save --------------------------------------------------------------------------------------------

def _nested_state() -> dict:
    return {
        "model": {"w": _with_nan(_t((4, 6))), "b": _t((6,), torch.bfloat16, 1), "n": torch.tensor(3)},
        "optim": {"state": {0: {"exp_avg": _t((4, 6), seed=2), "step": torch.tensor(5.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
        "pair": (_t((2,), torch.int16, 3), "tag"),
        "list": [_t((3,), torch.float64, 4), 5, None],
        "epoch": 3,
        "name": "run-1",
    }


def test_a_torch_save_file_with_nesting_and_plain_values(tmp_path):
    state = _nested_state()
    path = str(tmp_path / "state.pt")
    torch.save(state, path)
    assert_tree_equal(shardckpt.load_full(path), state)  # tuples stay tuples, int keys stay ints
    assert_tree_equal(shardckpt.load_full(path, keys=["optim.state", "epoch"]),
                      {"optim": {"state": state["optim"]["state"]}, "epoch": 3})
    assert_tree_equal(shardckpt.load_full(path, keys=["optim.param_groups"]),
                      {"optim": {"param_groups": state["optim"]["param_groups"]}})  # a tensor-free subtree
    assert_tree_equal(shardckpt.load_full(path, keys=["list.1"]), {"list": [None, 5]})  # positions kept
    assert shardckpt.load_full(path, keys=["nothing"]) == {}


def test_a_torch_save_file_of_one_tensor_or_a_list(tmp_path):
    one = _t((3, 2), seed=7)
    torch.save(one, tmp_path / "one.pt")
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "one.pt")), one)
    torch.save([one, {"x": 1}], tmp_path / "list.pt")
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "list.pt")), [one, {"x": 1}])


def test_a_legacy_torch_save_file(tmp_path):
    state = {"w": _t((5, 5)), "step": 2}
    path = str(tmp_path / "legacy.pt")
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert_tree_equal(shardckpt.load_full(path), state)


# --- torch DCP ---------------------------------------------------------------------------------------------

def _dcp_state() -> dict:
    return {
        "model": {"embed.weight": _with_nan(_t((10, 4), seed=1)), "norm": _t((4,), torch.bfloat16, 2),
                  "counts": _t((3, 3), torch.int32, 3)},
        "optim": {"state": {"embed.weight": {"exp_avg": _t((10, 4), seed=4), "step": torch.tensor(9.0)}},
                  "param_groups": [{"lr": 0.01, "params": ["embed.weight"]}]},
        "step": 12,
    }


def _dcp_save(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=path)


@pytest.fixture
def dcp_dir(tmp_path):
    path = str(tmp_path / "dcp")
    _dcp_save(_dcp_state(), path)
    return path


@pytest.mark.parametrize("verify", [True, False])
def test_a_torch_dcp_directory(dcp_dir, verify):
    state = _dcp_state()
    assert_tree_equal(shardckpt.load_full(dcp_dir, verify_checksums=verify), state)
    assert_tree_equal(shardckpt.load_full(dcp_dir, keys=["model.norm", "step"]),
                      {"model": {"norm": state["model"]["norm"]}, "step": 12})
    assert_tree_equal(shardckpt.load_full(dcp_dir, keys=["optim.state"]),
                      {"optim": {"state": state["optim"]["state"]}})


def test_a_dcp_metadata_claiming_an_unbacked_huge_tensor_is_refused_before_allocating(dcp_dir):
    """A chunk with a stream transform has no size the reader can check at open; ``load_full`` still refuses a
    total no machine's memory holds, with a CheckpointError, before allocating anything."""
    meta = os.path.join(dcp_dir, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)  # trusted: torch wrote it in this test
    entry = md.state_dict_metadata["model.norm"]
    entry.size = torch.Size([1 << 46])
    entry.chunks[0].sizes = torch.Size([1 << 46])
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.norm")
    info.transform_descriptors = ["stream.zstd"]
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match=r"'model.norm' of shape \(70368744177664,\).*memory and swap"):
        shardckpt.load_full(dcp_dir)


# --- all formats -------------------------------------------------------------------------------------------

def test_the_memory_guard_counts_only_the_selected_tensors(tmp_path, monkeypatch):
    tensors = {"big": _t((64, 64)), "small": _t((4,))}
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_file(tensors, path)
    monkeypatch.setattr(load_any, "memory_limit", lambda: 1024)
    with pytest.raises(CheckpointError, match=r"needs 16,400 bytes .* the largest 'big'"):
        shardckpt.load_full(path)
    assert_tree_equal(shardckpt.load_full(path, keys=["small"]), {"small": tensors["small"]})


def test_a_place_with_no_checkpoint_is_not_found(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match="Looked for"):
        shardckpt.load_full(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.load_full(str(tmp_path / "notes.txt"))


def test_shardckpt_checkpoints_take_their_own_path(tmp_path):
    state = {"model": {"w": _t((8, 3))}, "step": 1}
    shardckpt.save(state, str(tmp_path / "ck"))
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "ck")), state)
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "ck"), keys=["step"]), {"step": 1})
