"""``formats.flat.read_flat``: flat ranges of tensors, as stored, into one byte buffer (a convert's small chunks).
shardckpt's own reader copies the ranges of tensors stored whole as one raw block itself and leaves the rest to
``read``; every reader gives the bytes of the tensors; a bad request raises before a byte is written; a damaged
chunk is named as ``read`` names it."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.formats import native
from shardckpt.formats.detect import open_reader
from shardckpt.formats.flat import FlatRead, read_flat
from shardckpt.formats.native import flat_reads
from shardckpt.formats.native import reader as native_reader
from shardckpt.regions import FlatRange
from tests._helpers import flip_byte, manifest_of
from tests.checkpoint.cases import block_size
from tests.checkpoint.test_per_tensor_paths import _reseal_crc
from tests.convert.test_convert_runs import _chunk_offset
from tests.formats._save_as import save_as

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.complex64, torch.float8_e4m3fn]
UNTOUCHED = 0xAB  # what the buffer holds where no read lands


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    sd = {}
    for i, dtype in enumerate(DTYPES):  # random bit patterns (NaN payloads included), 1-40 elements
        n = 1 + 7 * i % 40
        sd[f"t{i}"] = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    sd["mask"] = torch.rand(9, generator=g) > 0.5
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["matrix"] = torch.randn(6, 5, generator=g)
    sd["big"] = torch.randn(3000, generator=g)
    return sd


def _reads(sd: dict) -> list[FlatRead]:
    """Each tensor whole, its first half, its last element and an empty range, each 16-byte aligned, in an order
    other than the file's."""
    reads, at = [], 0
    for name in sorted(sd, reverse=True):
        t = sd[name]
        n = t.numel()
        for region in (FlatRange(0, n), FlatRange(0, n // 2), FlatRange(n - 1, n), FlatRange(n // 2, n // 2)):
            reads.append(FlatRead(name, region, t.dtype, at))
            at = -(-(at + region.numel * t.dtype.itemsize) // 16) * 16
    return reads


def _buffer(reads: list[FlatRead]) -> torch.Tensor:
    last = reads[-1]
    return torch.full((last.at + last.region.numel * last.dtype.itemsize + 16,), UNTOUCHED, dtype=torch.uint8)


def _expected(sd: dict, reads: list[FlatRead], size: int) -> torch.Tensor:
    want = torch.full((size,), UNTOUCHED, dtype=torch.uint8)
    for r in reads:
        part = sd[r.tensor].reshape(-1)[r.region.start:r.region.stop].contiguous().view(torch.uint8)
        want[r.at:r.at + part.numel()] = part
    return want


def _saved(fmt: str, sd: dict, root) -> str:
    path = str(root / "ckpt")
    if fmt == "shardckpt-zstd":
        shardckpt.save(sd, path, compress="zstd")
    elif fmt == "shardckpt-blocks":  # 64-byte blocks: every tensor past one block is read the general way
        with block_size(64):
            shardckpt.save(sd, path)
    elif fmt == "shardckpt-incremental":
        shardckpt.save(sd, os.path.join(path, "step-1"), incremental=True)
        path = os.path.join(path, "step-1")
    else:
        save_as(fmt, sd, path)
    return path


@pytest.mark.parametrize("fmt", ["shardckpt", "shardckpt-zstd", "shardckpt-blocks", "shardckpt-incremental",
                                 "torch", "safetensors", "dcp"])
def test_every_reader_lands_each_range_bit_for_bit_and_nothing_else(tmp_path, fmt):
    sd = _state()
    reads = _reads(sd)
    buffer = _buffer(reads)
    read_flat(open_reader(_saved(fmt, sd, tmp_path)), reads, buffer)
    assert torch.equal(buffer, _expected(sd, reads, buffer.numel()))


def test_the_own_reader_copies_small_whole_tensors_itself_and_leaves_the_rest_to_read(tmp_path, monkeypatch):
    sd = _state()
    path = str(tmp_path / "c")
    shardckpt.save(sd, path)
    given = []
    real = native.NativeReader.read
    monkeypatch.setattr(native.NativeReader, "read",
                        lambda self, requests: (given.extend(r.tensor for r in requests), real(self, requests))[1])
    reads = _reads(sd)
    buffer = _buffer(reads)
    read_flat(open_reader(path), reads, buffer)
    assert torch.equal(buffer, _expected(sd, reads, buffer.numel()))
    left = [r.tensor for r in reads if r.tensor == "mask" or not r.region.numel]  # bools, and nothing to read
    assert sorted(given) == sorted(left)


def test_windows_on_an_object_store_are_read_on_threads_bit_for_bit(monkeypatch):
    sd = _state()
    url = "memory://flat-reads/ckpt"
    shardckpt.save(sd, url)
    monkeypatch.setattr(native_reader, "SPAN_BYTES", 256)  # many windows
    pools = []
    real_pool = flat_reads.ThreadPoolExecutor
    monkeypatch.setattr(flat_reads, "ThreadPoolExecutor", lambda *a, **k: pools.append(1) or real_pool(*a, **k))
    reads = _reads(sd)
    buffer = _buffer(reads)
    read_flat(open_reader(url), reads, buffer)
    assert pools and torch.equal(buffer, _expected(sd, reads, buffer.numel()))


@pytest.mark.parametrize("bad, error, match", [
    (FlatRead("nope", FlatRange(0, 1), torch.float32, 0), IncompatibleCheckpointError, "no tensor 'nope'"),
    (FlatRead("matrix", FlatRange(20, 31), torch.float32, 0), IncompatibleCheckpointError, "'matrix'.*exceeds"),
    (FlatRead("matrix", FlatRange(0, 2), torch.float32, 2), ValueError, "does not fit"),  # not aligned
    (FlatRead("big", FlatRange(0, 3000), torch.float32, 0), ValueError, "does not fit"),  # past the buffer
    (FlatRead("matrix", FlatRange(0, 2), torch.float32, -8), ValueError, "does not fit"),
])
@pytest.mark.parametrize("fmt", ["shardckpt", "safetensors"])
def test_a_bad_read_raises_before_a_byte_is_written(tmp_path, fmt, bad, error, match):
    sd = _state()
    reads = _reads(sd)[:40] + [bad]  # the good ones first: they would land if the checks came late
    buffer = _buffer(reads[:40])
    reader = open_reader(_saved(fmt, sd, tmp_path))
    with pytest.raises(error, match=match):
        read_flat(reader, reads, buffer)
    assert (buffer == UNTOUCHED).all()


def test_a_buffer_that_is_not_contiguous_uint8_cpu_is_refused(tmp_path):
    sd = _state()
    shardckpt.save(sd, tmp_path / "c")
    reader = open_reader(tmp_path / "c")
    reads = [FlatRead("matrix", FlatRange(0, 2), torch.float32, 0)]
    for buffer in (torch.zeros(16, dtype=torch.float32), torch.zeros(64, dtype=torch.uint8)[::2],
                   torch.zeros(80, dtype=torch.uint8)[1:]):
        with pytest.raises(ValueError, match="flat reads go to"):
            read_flat(reader, reads, buffer)


def test_the_own_readers_fast_path_checks_the_buffer_when_called_directly(tmp_path):
    sd = _state()
    shardckpt.save(sd, tmp_path / "c")
    reader = open_reader(tmp_path / "c")
    buffer = torch.full((8,), UNTOUCHED, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):  # (it copies to the addresses the reads name)
        reader.read_flat([FlatRead("big", FlatRange(0, 3000), torch.float32, 0)], buffer)
    assert (buffer == UNTOUCHED).all()


def test_a_damaged_chunk_is_named_and_verify_off_reads_it_as_stored(tmp_path):
    sd = _state()
    path = str(tmp_path / "c")
    shardckpt.save(sd, path)
    data, offset = _chunk_offset(path, "t3")
    flip_byte(data, offset + 2)
    reads = [FlatRead("t0", FlatRange(0, 1), torch.float32, 0), FlatRead("t3", FlatRange(0, 2), torch.bfloat16, 16)]
    with pytest.raises(CorruptCheckpointError, match=f"{os.path.basename(data)}.*'t3'"):
        read_flat(open_reader(path), reads, torch.zeros(32, dtype=torch.uint8))
    buffer = torch.zeros(32, dtype=torch.uint8)
    read_flat(open_reader(path, verify=False), reads, buffer)
    got = buffer[16:20].view(torch.bfloat16)
    assert not torch.equal(got.view(torch.int16), sd["t3"][:2].view(torch.int16))  # the flipped byte, as stored
    assert torch.equal(buffer[0:4].view(torch.float32), sd["t0"][:1])


def test_a_resealed_whole_tensor_checksum_is_refused_for_part_of_the_tensor(tmp_path):
    sd = _state()
    path = str(tmp_path / "c")
    shardckpt.save(sd, path)
    _reseal_crc(path, "matrix", manifest_of(path).tensors["matrix"].crc32c ^ 1)
    with pytest.raises(CorruptCheckpointError, match="'matrix'.*combine to checksum"):
        read_flat(open_reader(path), [FlatRead("matrix", FlatRange(3, 7), torch.float32, 0)],
                  torch.zeros(16, dtype=torch.uint8))
