"""Compressed checkpoints (format v3): zstd frames, byte planes for floats, random access by frame (issue 13)."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import CorruptCheckpointError, FlatRange, ShardedTensor
from shardckpt.checkpoint.describe import describe
from shardckpt.checkpoint.load import load_pieces
from shardckpt.checkpoint.verify import verify
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.format.dtypes import DTYPES
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.native import NativeReader, frames, read_manifest
from shardckpt.io.local import LocalStorage
from tests._helpers import flip_byte, load_state_matches
from tests._dist import run_ranks
from tests.checkpoint.cases import block_size
from tests.storage._util import assert_tree_equal, index_rows


def _smooth(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Trained-weight-like values (compressible in byte planes), deterministic."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return (x * 1000).round().clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max).to(dtype)
    return x.to(dtype)


def _rows(path: str) -> dict:
    out = {}
    for index in glob.glob(os.path.join(path, "data-*", "*.index.json")):
        for row in index_rows(open(index, "rb").read()):
            out[(row[0], row[1])] = (index[:-len(".index.json")] + ".bin", row)
    return out


@pytest.mark.parametrize("block", [1 << 20, 256])
def test_every_dtype_round_trips_bit_exact(tmp_path, block):
    sd = {f"t_{name}": _smooth(3000, dtype).reshape(30, 100) for name, dtype in DTYPES.items()}
    sd.update({"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 7), "empty_bf16": torch.zeros(3, 0).bfloat16(),
               "int_scalar": torch.tensor(-3), "noise": torch.randint(0, 256, (5000,), dtype=torch.uint8),
               "zeros": torch.zeros(100_000), "step": 7})
    path = str(tmp_path / "c")
    with block_size(block):
        shardckpt.save(sd, path, compress="zstd")
    assert_tree_equal(shardckpt.load_full(path), sd)
    report = verify(path)
    assert report.ok and report.version == 3, report.problems
    codecs = {name: row[5] for (name, _), (_, row) in _rows(path).items()}
    assert codecs["t_bfloat16"] == "zstd-planes" and codecs["t_complex64"] == "zstd-planes"
    assert codecs["t_int64"] == "zstd" and codecs["t_float8_e4m3fn"] == "zstd" and codecs["t_bool"] == "zstd"
    assert codecs["noise"] == "raw"  # random bytes do not shrink: stored raw, with no frame table
    assert codecs["zeros"] == "zstd-planes"


def test_checksums_and_diff_do_not_depend_on_the_codec(tmp_path):
    sd = {"w": _smooth(200_000, torch.bfloat16).reshape(400, 500), "b": _smooth(500, torch.float32)}
    raw, packed = str(tmp_path / "raw"), str(tmp_path / "zstd")
    shardckpt.save(sd, raw)
    shardckpt.save(sd, packed, compress="zstd:3")
    a, b = describe(raw), describe(packed)
    assert a["version"] == 2 and b["version"] == 3  # an uncompressed save stays readable by v2 readers
    assert [t["crc32c"] for t in a["tensors"]] == [t["crc32c"] for t in b["tensors"]]
    w = next(t for t in b["tensors"] if t["name"] == "w")
    assert w["codecs"] == ["zstd-planes"] and w["stored_bytes"] < w["bytes"] / 1.3
    assert b["stored_bytes"] < a["stored_bytes"]
    assert diff(raw, packed).equal


class _Counting(LocalStorage):
    """Local storage that counts the bytes read from data files."""

    read = 0

    def read_into(self, path, offset, buf):
        if path.endswith(".bin"):
            type(self).read += len(buf)
        return super().read_into(path, offset, buf)


def test_partial_reads_decode_only_the_frames_they_overlap(tmp_path, monkeypatch):
    rows, cols = 1024, 1024  # 4 MiB of fp32: 4 frames of 1 MiB, each compressed on its own
    full = _smooth(rows * cols, torch.float32).reshape(rows, cols)
    path = str(tmp_path / "c")
    shardckpt.save({"w": full}, path, compress="zstd")
    ((file, row),) = _rows(path).values()
    stored = row[7]
    assert len(stored) == 4 and sum(stored) < full.nbytes
    decoded = []
    real = frames.decode_frame
    monkeypatch.setattr(frames, "decode_frame", lambda codec, s, p, out: (decoded.append(len(out)), real(codec, s, p, out)))
    # Rows 300..310 lie in frame 1 (rows 256..511): one frame decoded.
    sd = {"w": ShardedTensor(torch.zeros(10, cols), (rows, cols), shardckpt.Box((300, 0), (10, cols)))}
    shardckpt.load(sd, path)
    assert torch.equal(sd["w"].local, full[300:310])
    assert decoded == [1 << 20]
    # A flat range across the frame 2/3 boundary: two frames.
    decoded.clear()
    got = torch.empty(2 * cols)
    load_pieces(path, lambda m: [ReadRequest("w", FlatRange(767 * cols, 769 * cols), got)])
    assert torch.equal(got, full[767:769].reshape(-1))
    assert decoded == [1 << 20, 1 << 20]


def test_partial_read_reads_only_its_frames_stored_bytes(tmp_path):
    rows, cols = 4096, 4096  # 64 MiB of bf16 at 1 MiB frames: reading 1/16 of the rows
    full = _smooth(rows * cols, torch.bfloat16).reshape(rows, cols)
    path = str(tmp_path / "c")
    shardckpt.save({"w": full}, path, compress="zstd")
    ((file, row),) = _rows(path).values()
    counting = _Counting(path)
    _Counting.read = 0
    reader = NativeReader(counting, read_manifest(counting))
    dest = torch.empty(rows // 16, cols, dtype=torch.bfloat16)
    reader.read([ReadRequest("w", shardckpt.Box((1000, 0), (rows // 16, cols)), dest.reshape(-1))])
    assert torch.equal(dest, full[1000:1000 + rows // 16])
    assert _Counting.read <= sum(row[7]) / 4, (_Counting.read, sum(row[7]))


def test_a_damaged_frame_is_named_and_never_crashes(tmp_path):
    full = _smooth(600_000, torch.bfloat16)
    path = str(tmp_path / "c")
    with block_size(64 << 10):
        shardckpt.save({"w": full}, path, compress="zstd")
    ((file, row),) = _rows(path).values()
    offset, stored = row[2], row[7]
    starts = [offset + sum(stored[:k]) for k in range(len(stored) + 1)]
    k = 5
    # Every byte of one compressed frame, one at a time: an error naming the frame, or (never) wrong data.
    for at in range(starts[k], starts[k + 1], max(1, (starts[k + 1] - starts[k]) // 97)):
        flip_byte(file, at, mask=0x5A)
        try:
            with pytest.raises(CorruptCheckpointError, match=rf"'w' chunk 0 frame {k} in file bytes "
                                                             rf"\[{starts[k]}, {starts[k + 1]}\)"):
                shardckpt.load_full(path)
            (problem,) = verify(path).problems
            assert f"frame {k}" in problem.message and problem.tensor == "w"
        finally:
            flip_byte(file, at, mask=0x5A)
    assert torch.equal(shardckpt.load_full(path)["w"], full)


def test_a_frame_claiming_more_than_its_block_is_refused():
    import zstandard

    from shardckpt.format.codecs import ZSTD, ZSTD_PLANES, FrameError, decode_frame

    out = memoryview(bytearray(1024))
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # 16 MiB of zeros in a few hundred bytes
    with pytest.raises(FrameError, match="claims 16777216 decoded bytes"):
        decode_frame(ZSTD, memoryview(bomb), 1, out)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1024))
    with pytest.raises(FrameError, match="claims -1"):
        decode_frame(ZSTD, memoryview(no_size), 1, out)
    planes = zstandard.ZstdCompressor().compress(bytes(range(256)) * 4)
    with pytest.raises(FrameError, match="does not decode"):
        decode_frame(ZSTD_PLANES, memoryview(planes)[:-3], 2, out)  # truncated
    two = zstandard.ZstdCompressor().compress(bytes(1024))
    with pytest.raises(FrameError):
        decode_frame(ZSTD, memoryview(two + two)[:1000], 1, out)  # trailing data after the frame


def _save_sharded(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _smooth(50_000, torch.bfloat16).reshape(500, 100)
    flat = _smooth(7001, torch.float32)
    with block_size(4096):
        shardckpt.save({"rows": ShardedTensor.from_full(full, rank, world),
                        "flat": ShardedTensor.even_flat_shard(flat, rank, world), "step": 3}, path,
                       compress="zstd:5")


def _load_sharded(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _smooth(50_000, torch.bfloat16).reshape(500, 100)
    flat = _smooth(7001, torch.float32)
    sd = {"rows": ShardedTensor.from_full(torch.zeros_like(full), rank, world),
          "flat": ShardedTensor.even_flat_shard(torch.zeros_like(flat), rank, world)}
    shardckpt.load(sd, path, strict=False)
    assert torch.equal(sd["rows"].local, ShardedTensor.from_full(full, rank, world).local)
    assert torch.equal(sd["flat"].local, ShardedTensor.even_flat_shard(flat, rank, world).local)


def test_resharding_loads_of_compressed_checkpoints_are_bit_exact(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _save_sharded, path)
    assert verify(path).ok and describe(path)["version"] == 3
    run_ranks(3, _load_sharded, path)
    # convert: compressed in, compressed or raw out, at another world size.
    out = str(tmp_path / "ws3")
    convert(path, out, world_size=3, compress="zstd")
    assert describe(out)["version"] == 3 and diff(path, out).equal
    plain = str(tmp_path / "plain")
    convert(out, plain, world_size=1)
    assert describe(plain)["version"] == 2 and diff(path, plain).equal
    assert_tree_equal(shardckpt.load_full(plain), shardckpt.load_full(path))


def test_compress_option_is_checked():
    from shardckpt.format.codecs import Compression

    assert Compression.parse("zstd") == Compression(1) and Compression.parse("zstd:-3") == Compression(-3)
    assert Compression.parse(None) is None and Compression.parse("none") is None
    for bad in ("zstd:0", "zstd:23", "gzip", "zstd:", 3):
        with pytest.raises(ValueError, match="compress must be"):
            Compression.parse(bad)


def test_inspect_shows_codecs_and_stored_size(tmp_path, capsys):
    from shardckpt.cli.main import main

    path = str(tmp_path / "c")
    shardckpt.save({"w": _smooth(100_000, torch.bfloat16), "i": torch.arange(10)}, path, compress="zstd")
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "compressed:" in out and "zstd-planes" in out and "stored" in out
    assert main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["stored_bytes"] < info["total_bytes"]


def _train_and_save_compressed(path: str) -> dict:
    from shardckpt import StateDictType
    from tests.runtime import _model
    from tests.state_dict._train import STEPS_BEFORE, full_state, new_run, steps

    model, optim = new_run()
    steps(model, optim, _model.make_batches(STEPS_BEFORE))
    with block_size(512):  # many frames per flat shard
        shardckpt.save_state(model, optim, path, type=StateDictType.LOCAL_STATE_DICT, compress="zstd")
    return full_state(model, optim)


def test_training_state_saves_compressed_and_resumes_at_another_world_size(tmp_path):
    path = str(tmp_path / "local")
    want = run_ranks(2, _train_and_save_compressed, path)[0]
    assert describe(path)["version"] == 3 and verify(path).ok
    run_ranks(3, load_state_matches, path, want, "compressed LOCAL")
    # Offline: the compressed LOCAL checkpoint converted to LOCAL at ws 3, compressed again.
    out = str(tmp_path / "ws3")
    convert(path, out, world_size=3, type="local", compress="zstd:2")
    run_ranks(3, load_state_matches, out, want, "compressed LOCAL converted to ws 3")


_FORKED = """
import os, sys, torch, shardckpt
path = sys.argv[1]
shardckpt.load_full(path)  # the parent's codec pool now exists
pid = os.fork()
if pid == 0:
    os._exit(0 if torch.equal(shardckpt.load_full(path)["w"], torch.arange(4096.0)) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_saves_and_loads_compressed(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "c")
    shardckpt.save({"w": torch.arange(4096.0)}, path, compress="zstd")
    proc = subprocess.run([sys.executable, "-c", _FORKED, path], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


class _FailingSecondRead(_Counting):
    """Fails the second read of a data file (a storage error mid-chunk)."""

    def read_into(self, path, offset, buf):
        if path.endswith(".bin"):
            type(self).read += 1
            if type(self).read == 2:
                raise OSError("connection reset")
        return LocalStorage.read_into(self, path, offset, buf)


def test_no_decode_writes_into_the_caller_after_a_read_error(tmp_path, monkeypatch):
    import time

    full = _smooth(6 << 20, torch.bfloat16)  # 12 MiB: batches of 16 MiB stored hold it in one read...
    path = str(tmp_path / "c")
    shardckpt.save({"w": full}, path, compress="zstd")
    monkeypatch.setattr(frames, "BATCH_BYTES", 2 << 20)  # ...so read it in batches of ~2 MiB
    real = frames.decode_frame

    def slow(*args):
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(frames, "decode_frame", slow)
    storage = _FailingSecondRead(path)
    _FailingSecondRead.read = 0
    dest = torch.zeros_like(full)
    with pytest.raises(OSError, match="connection reset"):
        NativeReader(storage, read_manifest(storage), io_threads=1).read([ReadRequest("w", FlatRange(0, full.numel()),
                                                                                      dest)])
    written = int((dest != 0).sum())
    time.sleep(0.5)
    assert int((dest != 0).sum()) == written  # every task ended before the error reached the caller


def test_a_manifest_claiming_more_than_its_frames_hold_is_refused_before_allocating(tmp_path):
    from tests.storage._util import manifest_doc, sealed

    path = str(tmp_path / "c")
    shardckpt.save({"w": torch.zeros(1 << 20)}, path, compress="zstd")  # 4 MiB of zeros: a few hundred bytes
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    claim = 3 << 19  # 6 MiB of float32: within 32768x of the ~200 bytes the file holds
    assert os.path.getsize(_rows(path)[("w", 0)][0]) * 32768 >= claim * 4
    doc["tensors"]["w"]["shape"] = [claim]
    doc["tensors"]["w"]["chunks"]["size"] = claim
    open(manifest, "wb").write(sealed(doc))
    with pytest.raises(CorruptCheckpointError, match=f"chunk 0 has {4 << 20} bytes, its region needs {claim * 4}"):
        shardckpt.load_full(path)


def test_inspect_of_a_damaged_compressed_checkpoint_still_describes_it(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save({"w": _smooth(10_000, torch.bfloat16), "i": torch.arange(100)}, path, compress="zstd")
    file, _ = next(iter(_rows(path).values()))
    with open(file, "ab") as f:
        f.write(b"x")  # the data file no longer has its recorded size
    info = describe(path)
    damaged = {name for (name, _), (f, _) in _rows(path).items() if f == file}
    # the damaged file's tensors: unknown, never guessed; a tensor whose file is sound keeps its stored form
    assert {t["name"] for t in info["tensors"] if t["stored_bytes"] is None} == damaged
    assert not verify(path).ok
