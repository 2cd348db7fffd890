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
from shardckpt.storage.checksum import crc32c, crc32c_combine, tensor_crc_term
from shardckpt.storage.manifest import ChunkRecord, FileEntry, index_to_bytes
from shardckpt.tensor_views import as_bytes

ALIGN = 64  # chunk offsets are aligned so that a memory map of the file gives aligned tensors
SEGMENT = 32 << 20  # bytes per write job: big chunks are split so that CRC and I/O overlap across threads


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


def _crc_term(piece: LocalPiece, crc: int, raw: torch.Tensor | None = None) -> int:
    """This chunk's term of the tensor checksum (see storage.checksum); ``raw`` is needed for box chunks only."""
    size = piece.data.element_size()
    total = math.prod(piece.shape) * size
    runs = list(contiguous_runs(piece.region, piece.shape))
    if len(runs) == 1:
        start, _, length = runs[0]
        return tensor_crc_term(crc, total - (start + length) * size)
    buf = (raw if raw is not None else _host_bytes(piece.data)).numpy()
    term = 0
    for start, local, length in runs:
        run_crc = crc32c(buf[local * size:(local + length) * size])
        term ^= tensor_crc_term(run_crc, total - (start + length) * size)
    return term


def _segments(piece: LocalPiece) -> list[tuple[int, int]]:
    """Byte ranges written (and checksummed) as separate jobs, so that CRC and writes overlap across threads.

    Only chunks already in contiguous CPU memory of one run are split: the others are staged (copied)
    once, whole, inside their single job.
    """
    t, n = piece.data, piece.data.nbytes
    if t.device.type != "cpu" or not t.is_contiguous() or len(list(contiguous_runs(piece.region, piece.shape))) != 1:
        return [(0, n)]
    return [(lo, min(lo + SEGMENT, n)) for lo in range(0, n, SEGMENT)] or [(0, 0)]


def write_rank_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, LocalPiece], io_threads: int) -> RankResult:
    """Write every task's chunk to ``data_path`` and its index to ``index_path``; both durable on return."""
    offsets, pos = [], 0
    for task in tasks:
        offsets.append(pos)
        pos += -(-pieces[task.name].data.nbytes // ALIGN) * ALIGN
    writer = storage.open_writer(data_path)
    try:
        if writer.positional:
            crcs = _write_positional(writer, tasks, pieces, offsets, io_threads)
        else:
            crcs = _write_sequential(writer, tasks, pieces, offsets)
    finally:
        writer.close()
    records: dict[tuple[str, int], ChunkRecord] = {}
    terms: dict[str, int] = {}
    for task, offset, (crc, term) in zip(tasks, offsets, crcs):
        records[(task.name, task.chunk)] = ChunkRecord(offset, pieces[task.name].data.nbytes, crc, "raw")
        terms[task.name] = terms.get(task.name, 0) ^ term
    size = offsets[-1] + pieces[tasks[-1].name].data.nbytes if tasks else 0
    index = index_to_bytes(records)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    return RankResult(FileEntry(data_path, size, index_path, len(index), crc32c(index)), terms)


def _write_positional(writer, tasks: list[WriteTask], pieces: dict[str, LocalPiece], offsets: list[int],
                      io_threads: int) -> list[tuple[int, int]]:
    """pwrite every segment from a thread pool; per chunk its CRC and checksum term."""
    jobs = [(i, lo, hi) for i, task in enumerate(tasks) for lo, hi in _segments(pieces[task.name])]

    def run(job: tuple[int, int, int]) -> tuple[int, int | None]:
        i, lo, hi = job
        piece = pieces[tasks[i].name]
        raw = _host_bytes(piece.data)
        view = memoryview(raw.numpy())[lo:hi]
        crc = crc32c(view)
        writer.pwrite(view, offsets[i] + lo)
        whole = lo == 0 and hi == raw.numel()
        return crc, _crc_term(piece, crc, raw) if whole else None

    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-write") as pool:
        done = list(pool.map(run, jobs))
    out: list[tuple[int, int]] = []
    for (i, lo, hi), (crc, term) in zip(jobs, done):
        if lo == 0:
            out.append((crc, term))
        else:  # a later segment of a split chunk: chain its CRC onto the chunk's
            chained = crc32c_combine(out[-1][0], crc, hi - lo)
            out[-1] = (chained, None)
        if hi == pieces[tasks[i].name].data.nbytes and out[-1][1] is None:
            out[-1] = (out[-1][0], _crc_term(pieces[tasks[i].name], out[-1][0]))
    return out


def _write_sequential(writer, tasks: list[WriteTask], pieces: dict[str, LocalPiece],
                      offsets: list[int]) -> list[tuple[int, int]]:
    """Object stores take one stream: chunks in order, zero padding between them."""
    out = []
    for i, task in enumerate(tasks):
        piece = pieces[task.name]
        raw = _host_bytes(piece.data)
        view = memoryview(raw.numpy())
        crc = crc32c(view)
        writer.write(view)
        if i + 1 < len(tasks):
            writer.write(memoryview(bytes(offsets[i + 1] - offsets[i] - raw.numel())))
        out.append((crc, _crc_term(piece, crc, raw)))
    return out
