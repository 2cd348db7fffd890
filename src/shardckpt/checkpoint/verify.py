"""``verify``: prove a checkpoint complete and uncorrupted, from its own bytes alone.

Checks, in order: the manifest's own checksum (format v2 on), that it parses and its chunks tile every
tensor exactly once (parse_manifest); every data file exists with the recorded size (before any loop
over chunks, so a hostile chunk count is bounded by real bytes); every index matches its recorded size
and CRC and lists exactly the chunks the manifest expects; every checksum block of every chunk matches
its CRC32C (a failure names the block's byte range); the blocks combine to the chunk's CRC; and the
per-tensor checksum, recombined from the bytes read, matches the manifest. With ``deep``, a pooled (v5)
checkpoint's chunks are also hashed with the pool's key and compared with the digest their index row records
(what an incremental save compares against: a wrong digest is a writer's bug that no read would notice; needs
``blake3``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from shardckpt.errors import CheckpointError, CorruptCheckpointError
from shardckpt.regions import contiguous_runs
from shardckpt.io import DEFAULT_IO_THREADS, Storage, open_storage
from shardckpt.format.checksum import SegmentedCRC, combine_block_crcs, runs_crc_term
from shardckpt.format.content_hash import ChunkHasher
from shardckpt.format.dtypes import itemsize
from shardckpt.format.index import ChunkRecord
from shardckpt.format.manifest import Manifest, TensorEntry, chunks_of
from shardckpt.formats.native import read_manifest
from shardckpt.formats.native.pool import files_view
from shardckpt.formats.native.frames import StoredChunk, block_problem, read_span
from shardckpt.formats.native.reader import Index, check_data_file, read_index, record_problem

READ_SIZE = 16 << 20  # bytes read at a time when checksumming a chunk


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
    version: int = 0
    manifest_checksum: bool = False  # False: format v1, whose manifest has no checksum to check
    problems: list[Problem] = field(default_factory=list)
    sharing: dict | None = None  # a pooled (v5) checkpoint's: checkpoint.pool.sharing_json
    digests_checked: int = 0  # deep: the chunks whose content digest was recomputed

    @property
    def ok(self) -> bool:
        return not self.problems


def _block_lengths(rec: ChunkRecord) -> Iterator[int]:
    for lo in range(0, rec.length, rec.block_size):
        yield min(rec.block_size, rec.length - lo)


def _scan_chunk(storage: Storage, path: str, rec: ChunkRecord, entry: TensorEntry, region,
                tick: Callable[[int], None], key: bytes | None = None) -> tuple[list[str], int | None]:
    """Problems found in one chunk's bytes, and (if none) its term of the tensor checksum. A compressed
    chunk is decoded (a frame that does not decode raises ``CorruptCheckpointError``). ``key``: also hash the bytes
    and compare with the row's digest."""
    size = itemsize(entry.dtype)
    runs = list(contiguous_runs(region, entry.shape))
    blocks = SegmentedCRC(_block_lengths(rec))
    # A box chunk is several runs of the tensor's bytes: one CRC per run for the tensor checksum.
    run_crcs = SegmentedCRC(n * size for _, _, n in runs) if len(runs) > 1 else None
    # Compressed chunks are read in whole frames; raw ones READ_SIZE at a time, whatever their block size.
    step = max(READ_SIZE // rec.block_size, 1) * rec.block_size if rec.frames else READ_SIZE
    buf = np.empty(min(step, rec.length), np.uint8)
    chunk = StoredChunk(storage, path, rec, size, False, "")
    hasher = ChunkHasher(key) if key is not None and rec.digest is not None else None
    for lo in range(0, rec.length, step):
        view = buf[:min(step, rec.length - lo)]
        read_span(chunk, lo, lo + len(view), [view])
        blocks.feed(view)
        if run_crcs is not None:
            run_crcs.feed(view)
        if hasher is not None:
            hasher.update(view)
        tick(len(view))
    problems = [block_problem(rec, k, got) for k, (want, got) in enumerate(zip(rec.blocks, blocks.crcs)) if want != got]
    if hasher is not None and not problems and hasher.digest() != rec.digest:
        problems.append(f"its bytes hash to {hasher.digest().hex()} under the pool's key, its index row records "
                        f"{rec.digest.hex()} (a writer's error: loads are unaffected, but an incremental save would "
                        "compare against a wrong digest)")
    if problems:
        return problems, None
    crc = combine_block_crcs(blocks.crcs, rec.length, rec.block_size)
    if crc != rec.crc32c:
        return [f"its block checksums combine to {crc:08x}, its index records {rec.crc32c:08x}"], None
    return [], runs_crc_term(runs, run_crcs.crcs if run_crcs is not None else [crc], size, entry.numel)


def _check_index(storage: Storage, manifest: Manifest, f: int, expected: set,
                 report: VerifyReport) -> Index | None:
    file = manifest.files[f]
    try:
        index = read_index(storage, file, manifest.version)
    except CorruptCheckpointError as e:
        report.problems.append(Problem(None, storage.url(file.path), str(e)))
        return None
    for name, chunk in sorted(set(index) - expected if manifest.pool is None else ()):  # pool files: shared
        report.problems.append(Problem(name, storage.url(file.index_path), f"index lists unknown chunk {chunk}"))
    return index


def _sized_files(storage: Storage, manifest: Manifest, report: VerifyReport) -> set[int]:
    """Files present with their recorded size; problems reported for the others."""
    good = set()
    for f, file in enumerate(manifest.files):
        try:
            check_data_file(storage, file)
            good.add(f)
        except CorruptCheckpointError as e:
            report.problems.append(Problem(None, storage.url(file.path), str(e)))
    return good


def _sharing(storage: Storage, manifest: Manifest) -> dict | None:
    if manifest.pool is None:
        return None
    from shardckpt.checkpoint.pool import sharing_json, sharing_of

    return sharing_json(sharing_of(storage, manifest))


def deep_hash_available() -> None:
    """Raise ``HashUnavailableError`` (typed, before anything is checked) if ``verify(deep=True)`` cannot hash."""
    from shardckpt.format.content_hash import HashUnavailableError, chunk_key

    try:
        chunk_key(bytes(32))
    except HashUnavailableError as e:
        raise HashUnavailableError("verify --deep hashes pooled chunks with BLAKE3: pip install "
                                   "'shardckpt[incremental]' (or blake3); a plain verify does not need it") from e


def _pool_key(step: Storage, manifest: Manifest) -> bytes | None:
    """The key a pooled checkpoint's digests are under (``verify(deep=True)``), once its pool was opened and checked
    (``files_view``)."""
    if manifest.pool is None:
        return None
    deep_hash_available()
    from shardckpt.format.content_hash import chunk_key
    from shardckpt.formats.native.pool import pool_storage, read_pool_info

    info = read_pool_info(pool_storage(step))
    if info is None:
        raise CorruptCheckpointError(f"{step.url('')}: its pool has no pool.json")
    return chunk_key(info.secret)


def verify(place: str | os.PathLike | Storage, *, io_threads: int = DEFAULT_IO_THREADS,
           progress: Callable[[int, int], None] | None = None, scanned: dict | None = None,
           deep: bool = False) -> VerifyReport:
    """Check everything about the checkpoint at ``place`` (a local path, or the place opened: ``shardckpt.verify``
    opens it with the caller's options); problems are collected, not raised.

    Raises ``CheckpointNotFoundError`` if there is no checkpoint, ``CorruptCheckpointError`` if the
    manifest itself is damaged. ``progress(done_bytes, total_bytes)`` is called as data is read. ``scanned``: what
    the checks of a pooled checkpoint's chunks found, kept across the checkpoints of one pool (``verify_run``): a
    chunk row of a pool file is the same bytes for every checkpoint that names it, so it is read once. ``deep``: see
    the module docstring.
    """
    step = open_storage(place)
    manifest = read_manifest(step)
    report = VerifyReport(tensors=len(manifest.tensors), version=manifest.version,
                          manifest_checksum=manifest.checksummed, sharing=_sharing(step, manifest))
    storage = files_view(step, manifest)  # a pooled (v5) checkpoint's files are its pool's
    digest_key = _pool_key(step, manifest) if deep else None
    sized = _sized_files(storage, manifest, report)
    expected: dict[int, set] = {f: set() for f in range(len(manifest.files))}
    jobs, unchecked = [], set()
    for entry in manifest.tensors.values():
        if not entry.chunks.files_used() <= sized:
            # Its file's problem is reported; skipping also bounds the loop below by bytes that exist.
            report.problems.append(Problem(entry.name, None, "not checked: a data file holding it is damaged"))
            unchecked.add(entry.name)
            continue
        for i, region, f in chunks_of(entry):
            expected[f].add((entry.name, i))
            jobs.append((entry, i, region, f))
    indexes = {f: _check_index(storage, manifest, f, expected[f], report) if f in sized else None
               for f in expected}
    total = sum(r.numel * itemsize(e.dtype) for e, _, r, _ in jobs)
    lock, done = threading.Lock(), [0]

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    def check(job) -> tuple[str, int | None]:
        entry, i, region, f = job
        file = storage.url(manifest.files[f].path)
        index = indexes[f]
        if index is None:
            return entry.name, None  # the file's problem is already reported
        rec = index.get((entry.name, i))
        problem = record_problem(rec, entry, region)
        if problem:
            report.problems.append(Problem(entry.name, file, f"chunk {i} {problem}"))
            return entry.name, None
        key = (manifest.files[f].path, entry.name, i, entry.dtype, entry.shape, region, rec)
        found = scanned.get(key) if scanned is not None and manifest.pool is not None else None
        if found is None:
            try:
                found = _scan_chunk(storage, manifest.files[f].path, rec, entry, region, tick, digest_key)
            except CorruptCheckpointError as e:  # a frame that does not decode
                found = [str(e).strip().removesuffix("; run `shardckpt verify`")], None
            if scanned is not None and manifest.pool is not None:
                scanned[key] = found
        problems, term = found
        report.problems.extend(Problem(entry.name, file, f"chunk {i} {p}") for p in problems)
        if digest_key is not None and rec.digest is not None:
            with lock:
                report.digests_checked += 1
        return entry.name, term

    terms: dict[str, int | None] = {name: None if name in unchecked else 0 for name in manifest.tensors}
    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-verify") as pool:
        for name, term in pool.map(check, jobs):
            terms[name] = None if term is None or terms[name] is None else terms[name] ^ term
    report.chunks, report.bytes_checked = len(jobs), done[0]
    _check_terms(manifest, terms, report)
    return report


def _check_terms(manifest: Manifest, terms: dict[str, int | None], report: VerifyReport) -> None:
    """Each tensor's checksum, recombined from its chunks' terms (None: not all could be read), against the
    manifest's."""
    for name, term in terms.items():
        entry = manifest.tensors[name]
        if term is not None and term != entry.crc32c:
            report.problems.append(Problem(name, None, f"tensor checksum {term:08x} differs from the manifest's "
                                                       f"{entry.crc32c:08x}"))


def verify_run(run: Storage, *, io_threads: int = DEFAULT_IO_THREADS,
               deep: bool = False) -> list[tuple[str, VerifyReport | CheckpointError]]:
    """``verify`` of every committed shardckpt checkpoint below run directory ``run`` (directly, and in the runs below
    it), by step, each chunk of their pool read once (a damaged shared chunk is reported for every checkpoint that
    names it); for each, its report, or the error that stopped its check (a damaged manifest, a missing pool)."""
    from shardckpt.checkpoint.runs import COMMITTED, RUN_DIR, UNREADABLE, list_checkpoints
    from shardckpt.format.manifest import FORMAT_NAME
    from shardckpt.io.navigate import child

    if deep:
        deep_hash_available()  # an environment's problem, not every step's
    scanned: dict = {}
    out: list[tuple[str, VerifyReport | CheckpointError]] = []
    for entry in list_checkpoints(run).checkpoints:
        if entry.state == RUN_DIR:  # a run of its own below (its own pool): its checkpoints too, named through it
            below = verify_run(child(run, entry.name), io_threads=io_threads, deep=deep)
            out += [(f"{entry.name}/{name}", found) for name, found in below]
            continue
        if entry.state == UNREADABLE:  # a manifest that does not parse: a damaged checkpoint, not none
            out.append((entry.name, CorruptCheckpointError(entry.detail)))
            continue
        if entry.state != COMMITTED or entry.format != FORMAT_NAME:
            continue
        try:
            out.append((entry.name, verify(child(run, entry.name), io_threads=io_threads, scanned=scanned, deep=deep)))
        except CheckpointError as e:
            out.append((entry.name, e))
    return out
