"""Writing one rank's data files from staged host buffers: checksum each block, write it, make the files durable.

The pieces come from ``checkpoint.stage`` (their ``data`` is already a contiguous CPU tensor: this module
copies nothing to the host). Each block's CRC32C is computed just before the block is written, while its
bytes are in cache; a call to the storage writer covers ``WRITE_SIZE`` bytes (whole blocks).
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.regions import contiguous_runs
from shardckpt.io import Storage
from shardckpt.format.codecs import RAW
from shardckpt.format.checksum import combine_block_crcs, crc32c, runs_crc_term
from shardckpt.format.index import BLOCK_SIZE, ChunkRecord, index_to_bytes
from shardckpt.format.manifest import FORMAT_VERSION, FileEntry
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


def _write_chunk(writer, piece: LocalPiece) -> tuple[ChunkRecord, int]:
    """Stream one chunk, each block checksummed just before it is written (while it is in cache).

    Returns the record (offset 0: the caller places it) and the chunk's term of the tensor checksum."""
    raw = _staged_bytes(piece)
    data = memoryview(raw.numpy())
    block = BLOCK_SIZE  # read at call time: tests shrink it to get many blocks from small tensors
    step = max(WRITE_SIZE // block, 1) * block  # writes end on block boundaries
    blocks = []
    for lo in range(0, len(data), step):
        piece_bytes = RAW.encode(data[lo:lo + step])  # raw: blocks are stored as they are, so `step` at once
        blocks.extend(crc32c(piece_bytes[k:k + block]) for k in range(0, len(piece_bytes), block))
        writer.write(piece_bytes)
    crc = combine_block_crcs(blocks, len(data), block)
    return ChunkRecord(0, len(data), crc, RAW.name, block, tuple(blocks)), _crc_term(piece, crc, raw)


def write_data_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, LocalPiece]) -> tuple[FileEntry, dict[str, int]]:
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
            record, term = _write_chunk(writer, piece)
            records[(task.name, task.chunk)] = dataclasses.replace(record, offset=pos)
            terms[task.name] = terms.get(task.name, 0) ^ term
            pos += piece.data.nbytes
    finally:
        writer.close()
    index = index_to_bytes(records, FORMAT_VERSION, BLOCK_SIZE)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    return FileEntry(data_path, pos, index_path, len(index), crc32c(index)), terms


def write_rank_files(storage: Storage, base: str, tasks: list[WriteTask], pieces: dict[str, LocalPiece],
                     files_per_rank: int) -> RankResult:
    """One data file per slot (``<base>-<slot>.bin``), written in parallel: one writer per file, because
    buffered writes to a single file serialise on its lock."""
    by_slot = [[t for t in tasks if t.slot == k] for k in range(files_per_rank)]

    def write(k: int) -> tuple[FileEntry, dict[str, int]]:
        return write_data_file(storage, f"{base}-{k}.bin", f"{base}-{k}.index.json", by_slot[k], pieces)

    with ThreadPoolExecutor(files_per_rank, thread_name_prefix="shardckpt-write") as pool:
        written = list(pool.map(write, range(files_per_rank)))
    terms: dict[str, int] = {}
    for _, file_terms in written:
        for name, term in file_terms.items():
            terms[name] = terms.get(name, 0) ^ term
    return RankResult([entry for entry, _ in written], terms)
