"""shardckpt's own format behind the one read interface (``formats.api.CheckpointReader``)."""
from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt import Box, FlatRange, IncompatibleCheckpointError
from shardckpt.format.checksum import crc32c
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.formats.native import NativeReader, read_manifest
from shardckpt.io import open_storage
from shardckpt.regions import full_region
from shardckpt.tensor_views import as_bytes


@pytest.fixture()
def saved(tmp_path):
    state = {"w": torch.arange(60, dtype=torch.float32).reshape(6, 10), "b": torch.tensor(2.5, dtype=torch.bfloat16),
             "e": torch.empty(0, 3), "step": 7}
    shardckpt.save(state, tmp_path / "ck")
    storage = open_storage(tmp_path / "ck")
    return state, NativeReader(storage, read_manifest(storage))


def test_it_presents_logical_tensors_with_their_checksums(saved):
    state, reader = saved
    assert isinstance(reader, CheckpointReader)
    info = reader.tensors()
    assert set(info) == {"w", "b", "e"}
    for name in info:
        t = state[name]
        assert (info[name].dtype, info[name].shape) == (t.dtype, tuple(t.shape))
        assert info[name].crc32c == crc32c(as_bytes(t.contiguous()).numpy())
    tree = reader.tree()
    assert tree["step"] == 7 and isinstance(tree["w"], TensorRef)


@pytest.mark.parametrize("region, want", [
    (Box((1, 2), (3, 4)), lambda w: w[1:4, 2:6]),
    (FlatRange(17, 44), lambda w: w.reshape(-1)[17:44]),
    (full_region((6, 10)), lambda w: w),
])
def test_read_fills_any_region_and_casts(saved, region, want):
    state, reader = saved
    exact = torch.empty(region.numel, dtype=torch.float32)
    cast = torch.empty(region.numel, dtype=torch.float64)
    reader.read([ReadRequest("w", region, exact), ReadRequest("w", region, cast)])
    assert torch.equal(exact, want(state["w"]).reshape(-1))
    assert torch.equal(cast, want(state["w"]).reshape(-1).double())


def test_0d_and_empty_tensors(saved):
    state, reader = saved
    b, e = torch.empty((), dtype=torch.bfloat16), torch.empty(0, 3)
    reader.read([ReadRequest("b", full_region(()), b), ReadRequest("e", full_region((0, 3)), e)])
    assert b.item() == 2.5 and e.shape == (0, 3)


@pytest.mark.parametrize("request_, error, message", [
    (ReadRequest("nope", FlatRange(0, 1), torch.empty(1)), IncompatibleCheckpointError, "no tensor 'nope'"),
    (ReadRequest("w", FlatRange(50, 61), torch.empty(11)), IncompatibleCheckpointError, "'w'"),
    (ReadRequest("w", Box((0, 0), (7, 1)), torch.empty(7)), IncompatibleCheckpointError, "'w'"),
    (ReadRequest("w", FlatRange(0, 4), torch.empty(5)), ValueError, "4 elements"),
    (ReadRequest("w", FlatRange(0, 4), torch.empty(4, 2)[:, 0]), ValueError, "contiguous"),
])
def test_bad_requests_are_refused_before_anything_is_read(saved, request_, error, message):
    _, reader = saved
    good = torch.full((3,), -1.0)
    with pytest.raises(error, match=message):
        reader.read([ReadRequest("w", FlatRange(0, 3), good), request_])
    assert torch.equal(good, torch.full((3,), -1.0))  # the good request before it was not executed either


def test_concurrent_reads_on_one_reader(saved):
    """A read pins and releases the storage's files; reads from several threads must not unpin each other's."""
    from concurrent.futures import ThreadPoolExecutor

    state, reader = saved

    def read_row(i: int) -> torch.Tensor:
        out = torch.empty(10)
        reader.read([ReadRequest("w", Box((i % 6, 0), (1, 10)), out)])
        return out

    with ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(read_row, range(48)))
    for i, row in enumerate(rows):
        assert torch.equal(row, state["w"][i % 6])
