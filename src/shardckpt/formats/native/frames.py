"""Reading a span of a chunk's logical bytes: as stored (``raw``), or by decoding the frames it covers.

A compressed chunk's frames are read ``BATCH_BYTES`` of stored bytes at a time and decoded on the codec
pool while the next batch is read, each straight into the caller's buffers (a frame that straddles two
buffers goes through a scratch buffer). With ``verify``, every block's CRC32C is checked: for ``raw`` over
the bytes read, for frames over the decoded bytes, as each is decoded. No frame outside the span is read.
"""
from __future__ import annotations

from concurrent.futures import wait
from dataclasses import dataclass

import numpy as np

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.checksum import SegmentedCRC, crc32c
from shardckpt.format.codecs import FrameError, codec_pool, decode_frame
from shardckpt.format.index import ChunkRecord
from shardckpt.io import Storage

BATCH_BYTES = 16 << 20  # stored bytes read per batch of frames


def block_problem(rec: ChunkRecord, k: int, got: int) -> str:
    """A failed block checksum, naming the block's (or its frame's) byte range in the data file."""
    if rec.frames:
        return (f"frame {k} in file bytes {_file_bytes(rec, k)} decodes to bytes that fail their checksum (block "
                f"{k}: stored {rec.blocks[k]:08x}, decoded {got:08x})")
    return f"fails its checksum in file bytes {_file_bytes(rec, k)} (block {k}: stored {rec.blocks[k]:08x}, read {got:08x})"


def _file_bytes(rec: ChunkRecord, k: int) -> str:
    """Where block ``k`` (or, compressed, its frame) is stored in the data file."""
    if rec.frames:
        a, b = rec.frame_starts[k], rec.frame_starts[k + 1]
    else:
        a, b = k * rec.block_size, min((k + 1) * rec.block_size, rec.length)
    return f"[{rec.offset + a}, {rec.offset + b})"


class _Parts:
    """Consecutive caller buffers that together hold logical bytes ``[start, ...)`` of a chunk."""

    def __init__(self, parts: list[np.ndarray], start: int):
        self.parts = [p for p in parts if p.nbytes]
        self.bounds = [start]
        for p in self.parts:
            self.bounds.append(self.bounds[-1] + p.nbytes)

    def view(self, lo: int, hi: int) -> memoryview | None:
        """Bytes ``[lo, hi)`` if they lie in one buffer."""
        for p, a, b in zip(self.parts, self.bounds, self.bounds[1:]):
            if a <= lo and hi <= b:
                return memoryview(p)[lo - a:hi - a]
        return None

    def scatter(self, data: memoryview, lo: int) -> None:
        """Copy ``data`` (bytes from ``lo`` on) into the buffers it spans."""
        for p, a, b in zip(self.parts, self.bounds, self.bounds[1:]):
            x, y = max(a, lo), min(b, lo + len(data))
            if x < y:
                memoryview(p)[x - a:y - a] = data[x - lo:y - lo]


@dataclass(frozen=True)
class StoredChunk:
    """One chunk as stored, and how its bytes are read: chunk ``rec`` of data file ``path`` in ``storage``, of
    items of ``itemsize`` bytes (for byte-plane codecs), its blocks checked with ``verify``; ``where`` begins
    error messages ("<file>: tensor 'w' chunk 3")."""

    storage: Storage
    path: str
    rec: ChunkRecord
    itemsize: int
    verify: bool
    where: str


def read_span(chunk: StoredChunk, start: int, stop: int, parts: list[np.ndarray]) -> None:
    """Fill ``parts`` (uint8 buffers, in order, ``stop - start`` bytes in all) with logical bytes ``[start, stop)``
    of ``chunk``. For a compressed chunk the span must be whole blocks (``rec.block_bounds``)."""
    storage, path, rec, verify, where = chunk.storage, chunk.path, chunk.rec, chunk.verify, chunk.where
    if rec.frames:
        _read_frames(chunk, start, stop, _Parts(parts, start))
        return
    pos = rec.offset + start
    for part in parts:
        if part.nbytes:
            storage.read_into(path, pos, memoryview(part))
            pos += part.nbytes
    if verify:
        check_raw_blocks(rec, start, stop, parts, where)


def check_raw_blocks(rec: ChunkRecord, start: int, stop: int, parts: list[np.ndarray], where: str) -> None:
    """Raise ``CorruptCheckpointError`` unless ``parts`` (logical bytes ``[start, stop)`` of raw chunk ``rec``, whole
    blocks) match the blocks' CRCs."""
    b = rec.block_size
    crcs = SegmentedCRC(min(b, stop - lo) for lo in range(start, stop, b))
    for part in parts:
        crcs.feed(part)
    for k, got in enumerate(crcs.crcs, start // b):
        if got != rec.blocks[k]:
            raise CorruptCheckpointError(f"{where} {block_problem(rec, k, got)}; run `shardckpt verify`")


def _read_frames(chunk: StoredChunk, start: int, stop: int, out: _Parts) -> None:
    storage, path, rec, itemsize, verify, where = (chunk.storage, chunk.path, chunk.rec, chunk.itemsize, chunk.verify,
                                                   chunk.where)
    b = rec.block_size
    if start % b or (stop % b and stop != rec.length):
        raise ValueError(f"a compressed span must be whole frames, got [{start}, {stop}) of {b}-byte frames")
    pool = codec_pool()

    def decode(k: int, stored: memoryview) -> None:
        lo, hi = k * b, min((k + 1) * b, rec.length)
        dest = out.view(lo, hi)
        target = dest if dest is not None else memoryview(bytearray(hi - lo))
        try:
            decode_frame(rec.codec, stored, itemsize, target)
        except FrameError as e:
            raise CorruptCheckpointError(f"{where} frame {k} in file bytes {_file_bytes(rec, k)} {e}; run "
                                         "`shardckpt verify`") from None
        got = crc32c(target) if verify else rec.blocks[k]
        if got != rec.blocks[k]:
            raise CorruptCheckpointError(f"{where} {block_problem(rec, k, got)}; run `shardckpt verify`")
        if dest is None:
            out.scatter(target, lo)

    pending: list = []
    try:
        for first, last in _batches(rec, start // b, -(-stop // b)):
            a, z = rec.frame_starts[first], rec.frame_starts[last]
            buf = memoryview(bytearray(z - a))
            storage.read_into(path, rec.offset + a, buf)  # while the previous batch decodes
            _raise_first([f.exception() for f in pending])
            pending = []
            for k in range(first, last):
                pending.append(pool.submit(decode, k, buf[rec.frame_starts[k] - a:rec.frame_starts[k + 1] - a]))
        _raise_first([f.exception() for f in pending])
    finally:
        wait(pending)  # on any error too: no task may write into the caller's buffers after this returns


def _raise_first(errors: list) -> None:
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _batches(rec: ChunkRecord, first: int, last: int):
    """Frames ``[first, last)`` in runs of about ``BATCH_BYTES`` stored bytes (at least one frame each)."""
    while first < last:
        end = first + 1
        while end < last and rec.frame_starts[end + 1] - rec.frame_starts[first] <= BATCH_BYTES:
            end += 1
        yield first, end
        first = end
