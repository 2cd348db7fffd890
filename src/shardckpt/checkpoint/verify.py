"""``verify``: prove a checkpoint complete and uncorrupted, from its own bytes alone.

Checks, in order: the manifest parses and its chunks tile every tensor exactly once (parse_manifest);
every data file exists with the recorded size; every index matches its recorded size and CRC and
lists exactly the chunks the manifest expects; every chunk's bytes match their CRC32C; and the
per-tensor checksum, recombined from the bytes read, matches the manifest.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from shardckpt.checkpoint.load import read_manifest
from shardckpt.checkpoint.reader import Index, read_index
from shardckpt.errors import CorruptCheckpointError
from shardckpt.regions import contiguous_runs
from shardckpt.storage.backend import Storage, open_storage
from shardckpt.storage.checksum import crc32c, crc32c_combine, tensor_crc_term
from shardckpt.storage.dtypes import itemsize
from shardckpt.storage.manifest import ChunkRecord, Manifest, TensorEntry, chunks_of

BLOCK = 16 << 20  # bytes read at a time when checksumming a chunk


@dataclass(frozen=True)
class Problem:
    tensor: str | None
    file: str | None
    message: str

    def __str__(self) -> str:
        where = " ".join(x for x in (f"tensor {self.tensor!r}" if self.tensor else "", self.file or "") if x)
        return f"{where}: {self.message}" if where else self.message


@dataclass
class VerifyReport:
    tensors: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _stream_crc(storage: Storage, path: str, offset: int, length: int, progress: Callable[[int], None]) -> int:
    crc, pos = 0, 0
    buf = bytearray(min(BLOCK, length))
    while pos < length:
        view = memoryview(buf)[:min(len(buf), length - pos)]
        storage.read_into(path, offset + pos, view)
        crc = crc32c(view, crc)
        pos += len(view)
        progress(len(view))
    return crc


def _chunk_crc(storage: Storage, path: str, rec: ChunkRecord, entry: TensorEntry, region,
               progress: Callable[[int], None]) -> tuple[int, int]:
    """A chunk's CRC32C, and its term of the tensor checksum (see storage.checksum)."""
    size = itemsize(entry.dtype)
    total = entry.numel * size
    crc, term = 0, 0
    # A box chunk is several runs of the tensor's bytes: one CRC per run, chained for the chunk's CRC.
    for start, local, length in contiguous_runs(region, entry.shape):
        run_crc = _stream_crc(storage, path, rec.offset + local * size, length * size, progress)
        crc = crc32c_combine(crc, run_crc, length * size)
        term ^= tensor_crc_term(run_crc, total - (start + length) * size)
    return crc, term


def _check_file(storage: Storage, manifest: Manifest, f: int, expected: set, report: VerifyReport) -> Index | None:
    file = manifest.files[f]
    try:
        index = read_index(storage, file)
    except CorruptCheckpointError as e:
        report.problems.append(Problem(None, storage.url(file.path), str(e)))
        return None
    for name, chunk in sorted(set(index) - expected):
        report.problems.append(Problem(name, storage.url(file.index_path), f"index lists unknown chunk {chunk}"))
    return index


def verify(path: str | os.PathLike, *, storage_options: dict | None = None, io_threads: int = 4,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check everything about the checkpoint at ``path``; problems are collected, not raised.

    Raises ``CheckpointNotFoundError`` if there is no checkpoint, ``CorruptCheckpointError`` if the
    manifest itself is unreadable. ``progress(done_bytes, total_bytes)`` is called as data is read.
    """
    storage = open_storage(path, storage_options)
    manifest = read_manifest(storage)
    report = VerifyReport(tensors=len(manifest.tensors))
    expected: dict[int, set] = {f: set() for f in range(len(manifest.files))}
    jobs = []
    for entry in manifest.tensors.values():
        for i, region, f in chunks_of(entry):
            expected[f].add((entry.name, i))
            jobs.append((entry, i, region, f))
    indexes = {f: _check_file(storage, manifest, f, expected[f], report) for f in expected}
    total = sum(r.numel * itemsize(e.dtype) for e, _, r, _ in jobs)
    lock, done = threading.Lock(), [0]

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress:
                progress(done[0], total)

    def check(job) -> tuple[str, int | None]:
        entry, i, region, f = job
        file = storage.url(manifest.files[f].path)
        index = indexes[f]
        if index is None:
            return entry.name, None  # the file's problem is already reported
        rec = index.get((entry.name, i))
        if rec is None:
            report.problems.append(Problem(entry.name, file, f"chunk {i} is missing from the index"))
            return entry.name, None
        if rec.length != region.numel * itemsize(entry.dtype):
            report.problems.append(Problem(entry.name, file, f"chunk {i} has {rec.length} bytes, its region needs "
                                                              f"{region.numel * itemsize(entry.dtype)}"))
            return entry.name, None
        try:
            crc, term = _chunk_crc(storage, manifest.files[f].path, rec, entry, region, tick)
        except CorruptCheckpointError as e:
            report.problems.append(Problem(entry.name, file, f"chunk {i}: {e}"))
            return entry.name, None
        if crc != rec.crc32c:
            report.problems.append(Problem(entry.name, file, f"chunk {i} fails its checksum (stored "
                                                              f"{rec.crc32c:08x}, read {crc:08x})"))
            return entry.name, None
        return entry.name, term

    terms: dict[str, int | None] = {name: 0 for name in manifest.tensors}
    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-verify") as pool:
        for name, term in pool.map(check, jobs):
            terms[name] = None if term is None or terms[name] is None else terms[name] ^ term
    report.chunks, report.bytes_checked = len(jobs), done[0]
    for name, term in terms.items():
        entry = manifest.tensors[name]
        if term is not None and term != entry.crc32c:
            report.problems.append(Problem(name, None, f"tensor checksum {term:08x} differs from the manifest's "
                                                       f"{entry.crc32c:08x}"))
    return report

