"""Data files written past the page cache (``io.direct``): every length and split of the writes gives the same file
as a buffered write; file systems that refuse ``O_DIRECT`` get buffered writes; checkpoints are the same bytes."""
from __future__ import annotations

import errno
import os
import random

import pytest
import torch

import shardckpt
from shardckpt.io import direct
from shardckpt.io.direct import DIRECT_ALIGN, DIRECT_BUFFER, DirectWriter
from shardckpt.io.local import LocalStorage, _LocalWriter

SIZES = (0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, DIRECT_BUFFER - 1, DIRECT_BUFFER,
         DIRECT_BUFFER + 1, 2 * DIRECT_BUFFER + 12345)


def _write_in_pieces(writer, data: bytes, rng: random.Random) -> None:
    at = 0
    while at < len(data):
        n = rng.choice([1, 7, DIRECT_ALIGN, DIRECT_BUFFER // 3, DIRECT_BUFFER + 5, len(data)])
        writer.write(memoryview(data[at:at + n]))
        at += n
    writer.close()


@pytest.mark.parametrize("size", SIZES)
def test_every_length_and_split_writes_the_same_bytes(tmp_path, size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    storage = LocalStorage(str(tmp_path), direct_io=True)
    writer = storage.open_writer("d/f.bin")
    assert isinstance(writer, DirectWriter)  # ext4 or xfs under tmp_path: O_DIRECT is taken
    _write_in_pieces(writer, data, rng)
    with open(tmp_path / "d" / "f.bin", "rb") as f:
        assert f.read() == data
    assert os.path.getsize(tmp_path / "d" / "f.bin") == size  # the padding of the last write is cut off


def test_typed_views_are_written_as_their_bytes(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    writer = LocalStorage(str(tmp_path), direct_io=True).open_writer("f.bin")
    writer.write(memoryview(t.numpy()))  # a float view, not bytes
    writer.close()
    assert (tmp_path / "f.bin").read_bytes() == t.numpy().tobytes()


def test_a_file_system_refusing_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def open_(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:  # as tmpfs does
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    writer = LocalStorage(str(tmp_path), direct_io=True).open_writer("f.bin")
    assert isinstance(writer, _LocalWriter)
    writer.write(memoryview(b"abc"))
    writer.close()
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_a_file_system_refusing_direct_writes_goes_on_buffered(tmp_path, monkeypatch):
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    data = random.Random(1).randbytes(DIRECT_BUFFER + 999)
    _write_in_pieces(LocalStorage(str(tmp_path), direct_io=True).open_writer("f.bin"), data, random.Random(2))
    assert refused == [0] and (tmp_path / "f.bin").read_bytes() == data


def test_another_write_error_is_raised(tmp_path, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    writer = LocalStorage(str(tmp_path), direct_io=True).open_writer("f.bin")
    writer.write(memoryview(b"x" * 10))
    with pytest.raises(OSError, match="No space"):
        writer.close()


def test_a_file_written_on_after_kept_bytes_is_buffered(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"0123456789")
    writer = LocalStorage(str(tmp_path), direct_io=True).open_writer("f.bin", keep=3)
    assert isinstance(writer, _LocalWriter)
    writer.write(memoryview(b"abc"))
    writer.close()
    assert (tmp_path / "f.bin").read_bytes() == b"012abc"


def test_the_environment_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_DIRECT_IO", "0")
    assert not LocalStorage(str(tmp_path)).direct_io
    monkeypatch.delenv("SHARDCKPT_DIRECT_IO")
    assert LocalStorage(str(tmp_path)).direct_io


def test_a_checkpoint_is_the_same_bytes_either_way(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3000, 700, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
             "e": torch.empty(0), "s": torch.tensor(3.5), "step": 7}
    for flag in ("1", "0"):
        monkeypatch.setenv("SHARDCKPT_DIRECT_IO", flag)
        shardckpt.save(state, tmp_path / flag)
    for name in sorted(os.listdir(tmp_path / "1")):
        if name.endswith(".bin"):
            assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "0" / name).read_bytes(), name
    loaded = shardckpt.load_full(tmp_path / "1")
    assert all(torch.equal(loaded[k], state[k]) for k in ("w", "b", "e", "s")) and loaded["step"] == 7
    assert shardckpt.verify(tmp_path / "1").ok


def test_a_reused_buffer_leaves_nothing_of_the_last_file(tmp_path):
    """Buffers are kept for the next writers (a new one costs a fault per page): a short file written after a long
    one holds only its own bytes, whatever the last one left in the buffer; a second close gives nothing back
    twice; writers open at once never share one."""
    storage = LocalStorage(str(tmp_path), direct_io=True)
    long, short = b"\xaa" * (DIRECT_BUFFER + 3 * DIRECT_ALIGN + 5), b"\x55" * (DIRECT_ALIGN + 7)
    for name, data in (("long", long), ("short", short), ("empty", b"")):
        writer = storage.open_writer(f"{name}.bin")
        writer.write(memoryview(data))
        writer.close()
        writer.close()
        assert (tmp_path / f"{name}.bin").read_bytes() == data
    assert len(direct._idle) <= direct.KEEP_BUFFERS and len({id(b) for b in direct._idle}) == len(direct._idle)
    writers = [storage.open_writer(f"w{i}.bin") for i in range(direct.KEEP_BUFFERS + 2)]
    assert len({id(w._buf) for w in writers}) == len(writers)
    for i, writer in enumerate(writers):
        writer.write(memoryview(bytes([i]) * (DIRECT_ALIGN * 3 + i)))
    for writer in writers:
        writer.close()
    for i in range(len(writers)):
        assert (tmp_path / f"w{i}.bin").read_bytes() == bytes([i]) * (DIRECT_ALIGN * 3 + i)


def test_a_writer_that_failed_does_not_give_its_buffer_back(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path), direct_io=True)
    writer = storage.open_writer("f.bin")
    writer.write(memoryview(b"x" * 100))
    direct._idle.clear()
    monkeypatch.setattr(direct.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "injected")))
    with pytest.raises(OSError, match="injected"):
        writer.close()
    assert direct._idle == []


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_close_that_raised_is_not_done_again(tmp_path, monkeypatch, direct_io):
    """From helper-33: ``os.close`` may raise after closing the descriptor (a delayed write error on NFS or FUSE).
    A second ``close()`` then did it all again: it fsynced and closed the number, which a writer opened meanwhile had
    been given (that writer's bytes went to the next file), and gave the buffer back."""
    storage = LocalStorage(str(tmp_path), direct_io=direct_io)
    a = storage.open_writer("a.bin")
    a.write(memoryview(b"A" * 5000))
    real = os.close

    def close_then_raise(fd):
        real(fd)
        monkeypatch.setattr(direct.os, "close", real)
        raise OSError(errno.EIO, "injected: delayed write error")

    monkeypatch.setattr(direct.os, "close", close_then_raise)  # (the same os module for both writers)
    idle = len(direct._idle)
    with pytest.raises(OSError, match="delayed write"):
        a.close()
    assert len(direct._idle) == idle  # not given back
    b = storage.open_writer("b.bin")
    a.close()  # nothing: not b's descriptor closed
    b.write(memoryview(b"B" * 5000))
    b.close()
    assert (tmp_path / "b.bin").read_bytes() == b"B" * 5000
