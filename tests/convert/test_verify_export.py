"""``verify DST [--against SRC]`` on an export: its structure, and every value against the source (issue 10)."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main
from shardckpt.offline.export import INDEX_NAME, SINGLE_FILE, export
from shardckpt.offline.verify_export import verify_export
from shardckpt.errors import CheckpointError
from shardckpt.tensor_views import as_bytes

from tests._helpers import flip_byte


def _state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {"module.embed": torch.randn(64, 16, generator=g), "module.head": torch.randn(16, 64, generator=g),
             "module.norm": torch.randn(16, generator=g).to(torch.bfloat16), "module.pos": torch.arange(8),
             "module.scale": torch.tensor(0.5), "module.e": torch.empty(0, 3)}
    return {"model": model, "optim": {"state": {}, "param_groups": []}, "step": 3}


@pytest.fixture
def src(tmp_path) -> str:
    path = str(tmp_path / "src")
    shardckpt.save(_state(), path)
    return path


def _flip_a_value_byte(dst: str, file: str, tensor: str) -> None:
    path = os.path.join(dst, file)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    begin = json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    flip_byte(path, 8 + n + begin, 0x04)


@pytest.mark.parametrize("dtype", ["keep", "bfloat16", "float16"])
def test_an_export_verifies_against_its_source_kept_or_cast(src, tmp_path, dtype):
    dst = str(tmp_path / "out")
    report = export(src, dst, dtype=dtype, max_shard_size=2000)
    assert len(report.files) > 1  # sharded, with an index
    check = verify_export(dst, against=src)
    assert check.ok, (check.problems, check.values.differences)
    assert check.tensors == 6 and check.values.tensors == 6 and check.values.bytes_read > 0
    assert main(["verify", dst, "--against", src, "--quiet"]) == 0
    assert main(["verify", dst, "--quiet"]) == 0  # the structure alone


def test_a_flipped_value_byte_is_named(src, tmp_path, capsys):
    dst = str(tmp_path / "out")
    export(src, dst)
    _flip_a_value_byte(dst, SINGLE_FILE, "head")
    check = verify_export(dst, against=src)
    assert not check.ok
    assert [(d.name, d.kind) for d in check.values.differences] == [("head", "values")]
    assert main(["verify", dst, "--against", src, "--quiet"]) == 1
    assert "BAD head: values: 1 of 1024 elements differ" in capsys.readouterr().err
    assert verify_export(dst).ok  # safetensors stores no checksum: only the source can tell


def test_another_source_or_other_options_differ(src, tmp_path):
    dst = str(tmp_path / "out")
    export(src, dst, dtype="bfloat16")
    other = str(tmp_path / "other")
    shardckpt.save(_state(seed=2), other)
    diffs = verify_export(dst, against=other).values.differences
    assert {d.name for d in diffs if d.kind == "values"} == {"embed", "head", "norm"}  # pos is the same arange
    picked = str(tmp_path / "picked")
    export(src, picked, only=["model.module.embed"])
    assert verify_export(picked, against=src, only=["model.module.embed"]).ok
    diffs = verify_export(picked, against=src).values.differences  # without the options export was given
    assert {(d.name, d.kind) for d in diffs} >= {("embed", "only in A"), ("model.module.embed", "only in B")}


def test_the_structure_of_a_sharded_export(src, tmp_path):
    dst = str(tmp_path / "out")
    export(src, dst, max_shard_size=2000)
    index_path = os.path.join(dst, INDEX_NAME)
    index = json.load(open(index_path))
    assert verify_export(dst).ok

    def with_index(doc: dict) -> list[str]:
        json.dump(doc, open(index_path, "w"))
        return verify_export(dst).problems

    dropped = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != "pos"})
    assert any("tensors the index does not place here (first 'pos')" in p for p in with_index(dropped))
    alone = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != "head"})
    assert any("files the index does not name" in p for p in with_index(alone))  # head's file held only head
    lying = dict(index, metadata={"total_size": index["metadata"]["total_size"] + 4})
    assert any("total_size" in p for p in with_index(lying))
    with_index(index)
    open(os.path.join(dst, "model-00009-of-00009.safetensors"), "wb").write(open(
        os.path.join(dst, sorted(set(index["weight_map"].values()))[0]), "rb").read())
    assert any("files the index does not name" in p for p in verify_export(dst).problems)
    os.remove(os.path.join(dst, sorted(set(index["weight_map"].values()))[0]))
    with pytest.raises(CheckpointError):  # a file the index names is gone
        verify_export(dst)


def test_verify_against_a_shardckpt_checkpoint_is_refused(src, capsys):
    assert main(["verify", src, "--against", src, "--quiet"]) == 1
    assert "not a safetensors export" in capsys.readouterr().err


def test_the_cast_is_checked_against_the_cast_values(src, tmp_path):
    # An export whose bf16 values were rounded another way (truncated) does not pass as a cast export.
    dst = str(tmp_path / "out")
    export(src, dst, dtype="bfloat16")
    path = os.path.join(dst, SINGLE_FILE)
    raw = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])["embed"]["data_offsets"]
    truncated = (_state()["model"]["module.embed"].view(-1).view(torch.int32) >> 16).to(torch.int16)
    rounded = _state()["model"]["module.embed"].to(torch.bfloat16)
    assert not torch.equal(as_bytes(truncated), as_bytes(rounded))
    raw[8 + n + begin:8 + n + end] = bytes(as_bytes(truncated).numpy())
    open(path, "wb").write(bytes(raw))
    diffs = verify_export(dst, against=src).values.differences
    assert [d.name for d in diffs] == ["embed"]
