"""Destinations made under ``torch.inference_mode`` are filled by every reader (torch lets an inference tensor change
in place only inside that mode: the readers' copies were refused with torch's RuntimeError; helper-34)."""
from __future__ import annotations

import pytest
import torch

import shardckpt
from tests.formats._save_as import save_as
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.detect import open_reader
from shardckpt.regions import Box, FlatRange

STATE = {"a": torch.arange(12.0).reshape(3, 4), "i": torch.arange(6, dtype=torch.int32)}


def _inference(*shape, dtype=torch.float32) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("fmt", ["shardckpt", "torch", "safetensors", "dcp"])
def test_an_inference_destination_is_filled_as_read_cast_or_in_part(tmp_path, fmt):
    path = str(tmp_path / "ck")
    save_as(fmt, STATE, path)
    whole, cast, box = _inference(12), _inference(6, dtype=torch.float64), _inference(2, 2)
    open_reader(path).read([ReadRequest("a", FlatRange(0, 12), whole), ReadRequest("i", FlatRange(0, 6), cast),
                            ReadRequest("a", Box((1, 1), (2, 2)), box)])
    assert torch.equal(whole, STATE["a"].reshape(-1))
    assert torch.equal(cast, STATE["i"].double())
    assert torch.equal(box, STATE["a"][1:3, 1:3]) and whole.is_inference()


def test_load_into_an_inference_state_dict_casts_and_fills_strided_targets(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save(STATE, path)
    target = {"a": _inference(4, 3).t(), "i": _inference(6, dtype=torch.int64)}  # strided: staged, written back
    shardckpt.load(target, path, strict=False)
    assert torch.equal(target["a"], STATE["a"]) and torch.equal(target["i"], STATE["i"].long())
