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


def _reads_of_index(monkeypatch) -> list[str]:
    import shardckpt.formats.native.reader as native_reader

    calls, real = [], native_reader.read_index
    monkeypatch.setattr(native_reader, "read_index", lambda s, f, v: calls.append(f.path) or real(s, f, v))
    return calls


def test_a_reader_reads_each_index_once_however_many_reads_it_serves(tmp_path, monkeypatch):
    """A reader read tensor by tensor (convert, export) parsed a file's whole index on every read: quadratic in the
    tensors of a file (2,400 small tensors converted in 114 s, 48 ms each). Each index is now read once."""
    state = {f"t{i}": torch.full((3, 4), float(i)) for i in range(40)}
    shardckpt.save(state, tmp_path / "ck")
    storage = open_storage(tmp_path / "ck")
    reader = NativeReader(storage, read_manifest(storage))
    calls = _reads_of_index(monkeypatch)
    for name, t in state.items():
        out = torch.empty(t.numel())
        reader.read([ReadRequest(name, FlatRange(0, t.numel()), out)])
        assert torch.equal(out.view_as(t), t)
    assert len(calls) == len(reader.manifest.files) and len(set(calls)) == len(calls)
    dst = tmp_path / "ws2"
    shardckpt.convert(tmp_path / "ck", dst, world_size=2)
    assert len(calls) == 2 * len(reader.manifest.files)  # the convert's reader: once more each, not once a tensor
    assert shardckpt.diff(tmp_path / "ck", dst).equal


def test_a_damaged_index_is_refused_on_every_read_not_remembered(tmp_path):
    shardckpt.save({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path / "ck")
    storage = open_storage(tmp_path / "ck")
    reader = NativeReader(storage, read_manifest(storage))
    for file in reader.manifest.files:
        index = tmp_path / "ck" / file.index_path
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 1
        index.write_bytes(bytes(data))
    for name in ("a", "b", "a"):
        with pytest.raises(shardckpt.CorruptCheckpointError, match="chunk index is damaged"):
            reader.read([ReadRequest(name, FlatRange(0, 4), torch.empty(4))])
