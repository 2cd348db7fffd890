"""convert reads small chunks in runs (``offline.streams.FileRuns``): one read call for many neighbouring chunks,
each still checked against its own CRC and written bit for bit; cast, large and resumed chunks stream as before."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from tests._helpers import flip_byte, manifest_of
from tests.convert._spy import spy_reads


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(60):  # every dtype width, odd byte counts, 0-d and one-element tensors among them
        sd[f"f32.{i}"] = torch.randn(i % 7 + 1, 3, generator=g)
        sd[f"bf16.{i}"] = torch.randn(5, generator=g).to(torch.bfloat16)
        sd[f"i64.{i}"] = torch.randint(-2**40, 2**40, (i % 4 + 1,), generator=g)
        sd[f"mask.{i}"] = torch.rand(7, generator=g) > 0.5
        sd[f"u8.{i}"] = torch.randint(0, 255, (i % 5 + 1,), dtype=torch.uint8, generator=g)
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 4)
    sd["f32.big"] = torch.randn(300, 100, generator=g)  # past a run's chunk size: streamed in slices
    return {"model": sd, "step": 4}


def _reads(monkeypatch) -> list:
    """How many chunks each call to the source's reader reads (either way: ``tests.convert._spy``)."""
    calls = []
    spy_reads(monkeypatch, lambda reads: calls.append(len(reads)))
    return calls


@pytest.mark.parametrize("world_size", [1, 3])
def test_small_tensors_are_read_in_runs_and_converted_bit_for_bit(tmp_path, monkeypatch, world_size):
    src, dst = tmp_path / "src", tmp_path / "dst"
    state = _state()
    shardckpt.save(state, src)
    calls = _reads(monkeypatch)
    shardckpt.convert(src, dst, world_size=world_size)
    tensors = len(state["model"])
    assert max(calls) > 20 and len(calls) < tensors / 5  # runs, not a read per tensor
    loaded = shardckpt.load_full(dst)
    for name, want in state["model"].items():
        got = loaded["model"][name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert shardckpt.verify(dst).ok and shardckpt.diff(src, dst).equal


def test_a_cast_converts_small_tensors_one_by_one_and_exactly(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    state = _state()
    shardckpt.save(state, src)
    shardckpt.convert(src, dst, world_size=2, dtype="float16")
    loaded = shardckpt.load_full(dst)["model"]
    for name, want in state["model"].items():
        cast = want.to(torch.float16) if want.is_floating_point() else want
        assert loaded[name].dtype == cast.dtype and torch.equal(loaded[name], cast), name


def _chunk_offset(path, name: str) -> tuple[str, int]:
    """The data file and offset of tensor ``name``'s (only) chunk in a saved checkpoint."""
    manifest = manifest_of(path)
    for entry in manifest.files:
        with open(os.path.join(path, entry.index_path)) as f:
            for row in json.load(f)["chunks"]:
                if row[0] == name:
                    return os.path.join(path, entry.path), row[2]
    raise AssertionError(name)


def test_a_damaged_small_chunk_inside_a_run_is_refused_naming_it_and_nothing_is_committed(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    data, at = _chunk_offset(src, "model.f32.31")
    flip_byte(data, at + 5)
    with pytest.raises(shardckpt.CorruptCheckpointError, match=r"model\.f32\.31"):
        shardckpt.convert(src, dst, world_size=2)
    assert not os.path.exists(dst / "manifest.json")
