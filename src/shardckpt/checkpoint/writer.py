"""Writing one rank's data file: stage each chunk's bytes, checksum them, write them, make them durable."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.regions import contiguous_runs
from shardckpt.storage.backend import Storage
from shardckpt.storage.checksum import crc32c, tensor_crc_term
from shardckpt.storage.manifest import ChunkRecord, FileEntry, index_to_bytes
from shardckpt.tensor_views import as_bytes

ALIGN = 64  # chunk offsets are aligned so that a memory map of the file gives aligned tensors


@dataclass(frozen=True)
class RankResult:
    file: FileEntry
    crc_terms: dict[str, int]  # per tensor: XOR of this rank's chunks' checksum terms


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 view of ``t`` (copied only when it is on a device or not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return as_bytes(t.contiguous())


def _crc_term(piece: LocalPiece, raw: torch.Tensor, crc: int) -> int:
    """This chunk's term of the tensor checksum (see storage.checksum)."""
    size = piece.data.element_size()
    total = math.prod(piece.shape) * size
    runs = list(contiguous_runs(piece.region, piece.shape))
    if len(runs) == 1:
        start, _, length = runs[0]
        return tensor_crc_term(crc, total - (start + length) * size)
    buf = raw.numpy()
    term = 0
    for start, local, length in runs:
        run_crc = crc32c(buf[local * size:(local + length) * size])
        term ^= tensor_crc_term(run_crc, total - (start + length) * size)
    return term


def write_rank_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, LocalPiece], io_threads: int) -> RankResult:
    """Write every task's chunk to ``data_path`` and its index to ``index_path``; both durable on return."""
    offsets, pos = [], 0
    for task in tasks:
        offsets.append(pos)
        pos += -(-pieces[task.name].data.nbytes // ALIGN) * ALIGN
    writer = storage.open_writer(data_path)
    records: dict[tuple[str, int], ChunkRecord] = {}
    terms: dict[str, int] = {}

    def write_one(i: int) -> tuple[int, int, int]:
        piece = pieces[tasks[i].name]
        raw = _host_bytes(piece.data)
        view = memoryview(raw.numpy())
        crc = crc32c(view)
        if writer.positional:
            writer.pwrite(view, offsets[i])
        else:
            writer.write(view)
            pad = offsets[i + 1] - offsets[i] - raw.numel() if i + 1 < len(tasks) else 0
            writer.write(memoryview(bytes(pad)))
        return raw.numel(), crc, _crc_term(piece, raw, crc)

    try:
        if writer.positional and io_threads > 1:
            with ThreadPoolExecutor(io_threads, thread_name_prefix="shardckpt-write") as pool:
                results = list(pool.map(write_one, range(len(tasks))))
        else:
            results = [write_one(i) for i in range(len(tasks))]
    finally:
        writer.close()
    size = offsets[-1] + results[-1][0] if tasks else 0
    for task, offset, (length, crc, term) in zip(tasks, offsets, results):
        records[(task.name, task.chunk)] = ChunkRecord(offset, length, crc, "raw")
        terms[task.name] = terms.get(task.name, 0) ^ term
    index = index_to_bytes(records)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    return RankResult(FileEntry(data_path, size, index_path, len(index), crc32c(index)), terms)
