"""Writing one rank's data files from staged host buffers: checksum each block, write it, make the files durable.

The pieces come from ``checkpoint.stage`` (their ``data`` is already a contiguous CPU tensor: this module
copies nothing to the host). Each block's CRC32C is computed just before the block is written, while its
bytes are in cache; a call to the storage writer covers ``WRITE_SIZE`` bytes (whole blocks). With
compression, each block is encoded as one frame on ``format.codecs.codec_pool`` (its CRC taken in the same
task), a bounded number of frames ahead of the writes, so that encoding overlaps writing.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.regions import FlatRange, contiguous_runs
from shardckpt.io import Storage
from shardckpt.format.codecs import CODEC_THREADS, RAW, Compression, codec_pool, encode_frame
from shardckpt.format.checksum import combine_block_crcs, crc32c, runs_crc_term
from shardckpt.format.index import BLOCK_SIZE, ChunkRecord, index_to_bytes
from shardckpt.format.manifest import FileEntry, version_for
from shardckpt.tensor_views import as_bytes

ALIGN = 64  # chunk offsets are aligned so that a memory map of the file gives aligned tensors
WRITE_SIZE = 16 << 20  # bytes written per call (16 checksum blocks, each CRC'd just before, while in cache)


@dataclass(frozen=True)
class StreamedPiece:
    """A chunk written as it is produced, a slice at a time, so that it never needs to be in memory whole
    (``convert``: memory bounded whatever the chunk's size).

    ``slices(block)`` yields the chunk's elements in order, as contiguous CPU tensors of ``dtype``, each a
    whole number of ``block`` bytes (the checksum block) but the last. The region is one contiguous run of the
    tensor, so that the chunk's checksum term follows from its block CRCs alone."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    region: FlatRange
    slices: Callable[[int], Iterator[torch.Tensor]]


Piece = Union[LocalPiece, StreamedPiece]


@dataclass(frozen=True)
class RankResult:
    files: list[FileEntry]  # one per slot, in slot order
    crc_terms: dict[str, int]  # per tensor: XOR of this rank's chunks' checksum terms
    version: int | None = None  # the format version of the indexes written (None: not told)


def _staged_bytes(piece: LocalPiece) -> torch.Tensor:
    """The piece's staged bytes: a flat uint8 view of its host tensor (see ``checkpoint.stage``)."""
    t = piece.data
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise ValueError(f"{piece.name!r} is not staged: its data must be a contiguous CPU tensor without "
                         "conj/neg bits (checkpoint.stage.stage makes them)")
    return as_bytes(t)


def _crc_term(piece: Piece, size: int, crc: int, raw: torch.Tensor | None) -> int:
    """This chunk's term of the tensor checksum (see format.checksum): box chunks have one run per row (a
    ``LocalPiece`` only: its ``raw`` bytes give each run's CRC)."""
    runs = list(contiguous_runs(piece.region, piece.shape))
    if len(runs) == 1:
        crcs = [crc]
    else:
        buf = raw.numpy()
        crcs = [crc32c(buf[local * size:(local + n) * size]) for _, local, n in runs]
    return runs_crc_term(runs, crcs, size, math.prod(piece.shape))


def _write_raw(writer, data: memoryview, block: int) -> list[int]:
    """Write a chunk's bytes as they are, ``WRITE_SIZE`` at a time; returns its block CRCs."""
    step = max(WRITE_SIZE // block, 1) * block  # writes end on block boundaries
    blocks = []
    for lo in range(0, len(data), step):
        part = data[lo:lo + step]
        blocks.extend(crc32c(part[k:k + block]) for k in range(0, len(part), block))
        writer.write(part)
    return blocks


def _write_frames(writer, data: memoryview, block: int, codec: str, itemsize: int, level: int,
                  ) -> tuple[list[int], list[int]]:
    """Encode and write a chunk frame by frame; returns its block CRCs and its frames' stored lengths."""
    pool = codec_pool()

    def encode(lo: int) -> tuple[int, memoryview]:
        frame = data[lo:lo + block]
        return crc32c(frame), encode_frame(codec, frame, itemsize, level)

    starts = iter(range(0, len(data), block))
    # Frames encoded ahead of the writes, in order: enough to keep every codec thread busy, few enough
    # that memory stays a few blocks.
    pending = deque(pool.submit(encode, lo) for lo in itertools.islice(starts, 2 * CODEC_THREADS))
    blocks, frames = [], []
    while pending:
        crc, stored = pending.popleft().result()
        for lo in itertools.islice(starts, 1):
            pending.append(pool.submit(encode, lo))
        blocks.append(crc)
        frames.append(len(stored))
        writer.write(stored)
    return blocks, frames


def _write_chunk(writer, piece: Piece, compression: Compression | None) -> tuple[ChunkRecord, int]:
    """Stream one chunk, each block checksummed just before it is written (while it is in cache), encoded
    as a frame if ``compression``; a chunk none of whose frames shrank is recorded as ``raw``.

    Returns the record (offset 0: the caller places it) and the chunk's term of the tensor checksum."""
    block = BLOCK_SIZE  # read at call time: tests shrink it to get many blocks from small tensors
    if isinstance(piece, StreamedPiece):
        raw, dtype, parts = None, piece.dtype, map(as_bytes, piece.slices(block))
    else:
        raw = _staged_bytes(piece)
        dtype, parts = piece.data.dtype, iter([raw])
    codec = RAW if compression is None else compression.codec_for(dtype)
    blocks, frames, length = [], [], 0
    for part in parts:
        if length % block:
            raise ValueError(f"{piece.name!r}: a slice before the last ends mid-block ({length} bytes written, "
                             f"blocks of {block})")
        data = memoryview(part.numpy())
        if codec == RAW:
            blocks.extend(_write_raw(writer, data, block))
        else:
            part_blocks, stored = _write_frames(writer, data, block, codec, dtype.itemsize, compression.level)
            blocks.extend(part_blocks)
            frames.extend(stored)
        length += len(data)
    if codec != RAW and sum(frames) >= length:
        codec = RAW  # every frame was stored as it is: the stored bytes are the raw chunk
    crc = combine_block_crcs(blocks, length, block)
    record = ChunkRecord(0, length, crc, codec, block, tuple(blocks), tuple(frames) if codec != RAW else ())
    return record, _crc_term(piece, dtype.itemsize, crc, raw)


def write_data_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, Piece], compression: Compression | None = None, version: int | None = None,
                    ) -> tuple[FileEntry, dict[str, int]]:
    """Write the tasks' chunks in order (offsets aligned) and the file's index; both durable on return.

    ``pieces``: by name, staged pieces (``Staged.pieces``) or streamed ones. ``version``: the manifest's format
    version, which the index carries (default: ``version_for`` the compression)."""
    records: dict[tuple[str, int], ChunkRecord] = {}
    terms: dict[str, int] = {}
    writer, pos = storage.open_writer(data_path), 0
    try:
        for task in tasks:
            piece = pieces[task.name]
            pad = -pos % ALIGN
            if pad:
                writer.write(memoryview(bytes(pad)))
                pos += pad
            record, term = _write_chunk(writer, piece, compression)
            records[(task.name, task.chunk)] = dataclasses.replace(record, offset=pos)
            terms[task.name] = terms.get(task.name, 0) ^ term
            pos += record.stored_length
    finally:
        writer.close()
    index = index_to_bytes(records, version or version_for(compression is not None), BLOCK_SIZE)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    return FileEntry(data_path, pos, index_path, len(index), crc32c(index)), terms


def write_rank_files(storage: Storage, base: str, tasks: list[WriteTask], pieces: dict[str, Piece],
                     files_per_rank: int, compression: Compression | None = None,
                     version: int | None = None) -> RankResult:
    """One data file per slot (``<base>-<slot>.bin``), written in parallel: one writer per file, because
    buffered writes to a single file serialise on its lock."""
    by_slot = [[t for t in tasks if t.slot == k] for k in range(files_per_rank)]

    def write(k: int) -> tuple[FileEntry, dict[str, int]]:
        return write_data_file(storage, f"{base}-{k}.bin", f"{base}-{k}.index.json", by_slot[k], pieces,
                               compression, version)

    with ThreadPoolExecutor(files_per_rank, thread_name_prefix="shardckpt-write") as pool:
        written = list(pool.map(write, range(files_per_rank)))
    terms: dict[str, int] = {}
    for _, file_terms in written:
        for name, term in file_terms.items():
            terms[name] = terms.get(name, 0) ^ term
    return RankResult([entry for entry, _ in written], terms, version or version_for(compression is not None))
