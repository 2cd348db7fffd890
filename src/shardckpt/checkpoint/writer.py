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

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.regions import contiguous_runs
from shardckpt.io import Storage
from shardckpt.format.codecs import CODEC_THREADS, RAW, Compression, codec_pool, encode_frame
from shardckpt.format.checksum import combine_block_crcs, crc32c, runs_crc_term
from shardckpt.format.index import BLOCK_SIZE, ChunkRecord, index_to_bytes
from shardckpt.format.manifest import FileEntry, version_for
from shardckpt.tensor_views import as_bytes

ALIGN = 64  # chunk offsets are aligned so that a memory map of the file gives aligned tensors
WRITE_SIZE = 16 << 20  # bytes written per call (16 checksum blocks, each CRC'd just before, while in cache)


@dataclass(frozen=True)
class RankResult:
    files: list[FileEntry]  # one per slot, in slot order
    crc_terms: dict[str, int]  # per tensor: XOR of this rank's chunks' checksum terms


def _staged_bytes(piece: LocalPiece) -> torch.Tensor:
    """The piece's staged bytes: a flat uint8 view of its host tensor (see ``checkpoint.stage``)."""
    t = piece.data
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise ValueError(f"{piece.name!r} is not staged: its data must be a contiguous CPU tensor without "
                         "conj/neg bits (checkpoint.stage.stage makes them)")
    return as_bytes(t)


def _crc_term(piece: LocalPiece, crc: int, raw: torch.Tensor) -> int:
    """This chunk's term of the tensor checksum (see format.checksum): box chunks have one run per row."""
    size = piece.data.element_size()
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


def _write_chunk(writer, piece: LocalPiece, compression: Compression | None) -> tuple[ChunkRecord, int]:
    """Stream one chunk, each block checksummed just before it is written (while it is in cache), encoded
    as a frame if ``compression``; a chunk none of whose frames shrank is recorded as ``raw``.

    Returns the record (offset 0: the caller places it) and the chunk's term of the tensor checksum."""
    raw = _staged_bytes(piece)
    data = memoryview(raw.numpy())
    block = BLOCK_SIZE  # read at call time: tests shrink it to get many blocks from small tensors
    codec, frames = RAW, ()
    if compression is None:
        blocks = _write_raw(writer, data, block)
    else:
        codec = compression.codec_for(piece.data.dtype)
        blocks, stored = _write_frames(writer, data, block, codec, piece.data.element_size(), compression.level)
        if sum(stored) < len(data):
            frames = tuple(stored)
        else:
            codec = RAW  # every frame was stored as it is: the stored bytes are the raw chunk
    crc = combine_block_crcs(blocks, len(data), block)
    return ChunkRecord(0, len(data), crc, codec, block, tuple(blocks), frames), _crc_term(piece, crc, raw)


def write_data_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, LocalPiece], compression: Compression | None = None,
                    ) -> tuple[FileEntry, dict[str, int]]:
    """Write the tasks' chunks in order (offsets aligned) and the file's index; both durable on return.

    ``pieces``: staged pieces by name (``Staged.pieces``)."""
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
    index = index_to_bytes(records, version_for(compression is not None), BLOCK_SIZE)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    return FileEntry(data_path, pos, index_path, len(index), crc32c(index)), terms


def write_rank_files(storage: Storage, base: str, tasks: list[WriteTask], pieces: dict[str, LocalPiece],
                     files_per_rank: int, compression: Compression | None = None) -> RankResult:
    """One data file per slot (``<base>-<slot>.bin``), written in parallel: one writer per file, because
    buffered writes to a single file serialise on its lock."""
    by_slot = [[t for t in tasks if t.slot == k] for k in range(files_per_rank)]

    def write(k: int) -> tuple[FileEntry, dict[str, int]]:
        return write_data_file(storage, f"{base}-{k}.bin", f"{base}-{k}.index.json", by_slot[k], pieces,
                               compression)

    with ThreadPoolExecutor(files_per_rank, thread_name_prefix="shardckpt-write") as pool:
        written = list(pool.map(write, range(files_per_rank)))
    terms: dict[str, int] = {}
    for _, file_terms in written:
        for name, term in file_terms.items():
            terms[name] = terms.get(name, 0) ^ term
    return RankResult([entry for entry, _ in written], terms)
