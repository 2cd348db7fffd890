"""Executing a read plan: fetch the chunk indexes needed, then ranged-read chunk bytes on a thread pool.

A read is widened to whole checksum blocks around the needed span (at most one extra partial block at
each end) and every block is checked, so no byte reaches a caller unchecked while ``verify`` is on. A
compressed chunk's blocks are frames, decoded by ``frames.read_span``. On object stores, a file read
(nearly) whole is read through a few streaming GETs at once, each over its own stretch of the file, its reads
done in file order (``lanes.py``, ``Storage.stream``).
When the needed elements land contiguously, in stored order, in a CPU target of the same dtype, they are
read straight into the target's memory and only the widening goes to small side buffers; otherwise the
span is read into a buffer and copied piece by piece (any device, any dtype cast). Small chunks close together
in one file are read in runs, one ranged read each (``small_spans``), then checked and copied one by one.
"""
from __future__ import annotations

import ctypes
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from shardckpt.errors import CorruptCheckpointError
from shardckpt.regions import FlatRange, StridedView, strided_view
from shardckpt.io import Storage, lifecycle
from shardckpt.io.local import one_thread_suits
from shardckpt.format.checksum import crc32c
from shardckpt.format.codecs import ZSTD_PLANES
from shardckpt.format.dtypes import itemsize
from shardckpt.format.chunks import RegularChunks
from shardckpt.format.index import ChunkRecord, parse_index
from shardckpt.format.manifest import (
    COMPRESSED_VERSION, MANIFEST_NAME, FileEntry, Manifest, TensorEntry, chunks_of, min_stored_bytes,
)
from shardckpt.formats.native.frames import check_raw_blocks, StoredChunk, read_span
from shardckpt.formats.native.lanes import Piece, cut_read, lanes, share, stored_span
from shardckpt.formats.native.plan import ChunkRead
from shardckpt.formats.requests import CheckedRequest
from shardckpt.formats.native.whole_tensor import check_whole_tensors
from shardckpt.tensor_views import as_bytes, copy_into, from_bytes, view_of

Index = dict[tuple[str, int], ChunkRecord]
STREAM_FRACTION = 0.5  # an object-store file is streamed whole when at least this part of it is read
SMALL_CHUNK = 256 << 10  # chunks up to this size are read in runs (``small_spans``), not one ranged read each
SPAN_BYTES = 8 << 20  # the most bytes one run reads
SPAN_GAP = 64 << 10  # the most unneeded bytes a run reads between two of its chunks
BATCH_BYTES = 64 << 20  # the most bytes of consecutive chunks one task reads (``_batches``)


def check_data_file(storage: Storage, file: FileEntry) -> None:
    """The data file must have the size the manifest records (catches truncation and lying manifests early)."""
    size = storage.file_size(file.path)
    if size != file.size:
        raise CorruptCheckpointError(f"{storage.url(file.path)}: data file has {size} bytes, the manifest records "
                                     f"{file.size}")


def read_index(storage: Storage, file: FileEntry, version: int, memo: Callable | None = None) -> Index:
    """A data file's chunk index, checked against the size and CRC the manifest recorded for it. ``memo(where,
    data, parse)``, if given, may answer with an earlier parse of the same bytes (read only)."""
    check_data_file(storage, file)
    url = storage.url(file.index_path)
    data = storage.read_bytes(file.index_path)
    if len(data) != file.index_size or crc32c(data) != file.index_crc32c:
        raise CorruptCheckpointError(f"{url}: chunk index is damaged (size or checksum differs from the manifest)")
    if memo is None:
        return parse_index(data, version, file.size, url)
    return memo(("index", url, version, file.size), data, lambda: parse_index(data, version, file.size, url))


class Indexes:
    """The chunk indexes of one committed generation, each read and checked (``read_index``) once, when a read first
    needs it: a reader that reads tensor by tensor (convert, export) would otherwise read and parse a file's whole
    index again for every tensor, quadratic in the tensors of a file. A generation's index files never change (a
    new save writes a new generation), so a parsed one stays right for as long as the reader reads that
    generation."""

    def __init__(self, storage: Storage, manifest: Manifest):
        self._storage, self._manifest = storage, manifest
        self._parsed: dict[int, Index] = {}
        self._lock = threading.Lock()

    def of(self, files: set[int], io_threads: int) -> dict[int, Index]:
        with self._lock:  # one reader's reads may run on several threads
            missing = sorted(files - self._parsed.keys())
            nbytes = sum(self._manifest.files[f].index_size for f in missing)
            if len(missing) > 1 and not one_thread_suits(self._storage, nbytes):
                with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-read") as pool:
                    self._parsed.update(zip(missing, pool.map(self._read, missing)))
            else:
                self._parsed.update((f, self._read(f)) for f in missing)
            return {f: self._parsed[f] for f in files}

    def _read(self, f: int) -> Index:
        return read_index(self._storage, self._manifest.files[f], self._manifest.version)


def record_problem(rec: ChunkRecord | None, entry: TensorEntry, region) -> str | None:
    """What is wrong with a chunk's index record, given the region the manifest says it holds."""
    if rec is None:
        return "is missing from the file's index"
    if rec.length != region.numel * itemsize(entry.dtype):
        return f"has {rec.length} bytes, its region needs {region.numel * itemsize(entry.dtype)}"
    if rec.codec == ZSTD_PLANES and rec.block_size % itemsize(entry.dtype):
        return f"has {rec.block_size}-byte frames, which split its {entry.dtype} elements"
    return None


def check_stored(storage: Storage, manifest: Manifest, names: Iterable[str], indexes: Indexes | None = None,
                 io_threads: int = 1) -> None:
    """The stored bytes can hold tensors ``names`` as the manifest claims: checked before memory is allocated
    for them. From format v3 (compressed chunks: the files' sizes alone bound little) every chunk's index row is
    checked too: the rows of a file fit in it, and each frame is no smaller than zstd could make it. ``indexes``:
    the reader's, which keeps the indexes read here for its reads (``io_threads`` read them)."""
    entries = [manifest.tensors[name] for name in names]
    # The tensors of one form (format v6's table) share their chunks object: what follows from it is found once.
    used: dict[int, set[int]] = {}  # id(chunks) -> the files it places chunks in (bounded by the number of files)
    for entry in entries:
        if id(entry.chunks) not in used:
            used[id(entry.chunks)] = entry.chunks.files_used()
    files = sorted(set().union(*used.values()))
    for f in files:
        check_data_file(storage, manifest.files[f])
    nbytes: dict[tuple, int] = {}  # (dtype, shape, id(chunks)) -> bytes, for each form once
    for entry in entries:
        form = (entry.dtype, entry.shape, id(entry.chunks))
        if form in nbytes:
            continue
        nbytes[form] = entry.nbytes
        held = sum(manifest.files[f].size for f in used[id(entry.chunks)])
        if min_stored_bytes(entry, manifest.version) > held:
            raise CorruptCheckpointError(f"{storage.url(MANIFEST_NAME)}: tensor {entry.name!r} claims "
                                         f"{entry.nbytes} bytes in {len(entry.chunks)} chunks, which its data "
                                         f"files' {held} bytes cannot hold")
    if manifest.version >= COMPRESSED_VERSION:
        found = (indexes or Indexes(storage, manifest)).of(set(files), io_threads)
        for entry in entries:
            chunks = entry.chunks
            if type(chunks) is RegularChunks and chunks.count == 1:  # a tensor stored whole: the common row
                rec = found[chunks.file(0)].get((entry.name, 0))
                if rec is not None and rec.codec != ZSTD_PLANES and \
                        rec.length == nbytes[(entry.dtype, entry.shape, id(chunks))]:
                    continue  # (what record_problem finds of it; anything else is named below)
            for i, region, f in chunks_of(entry):
                problem = record_problem(found[f].get((entry.name, i)), entry, region)
                if problem:
                    raise CorruptCheckpointError(f"{storage.url(manifest.files[f].path)}: tensor {entry.name!r} "
                                                 f"chunk {i} {problem}")


def chunk_where(storage: Storage, manifest: Manifest, file: int, name: str, chunk: int) -> str:
    """How errors name a chunk: its data file, tensor and chunk number."""
    return f"{storage.url(manifest.files[file].path)}: tensor {name!r} chunk {chunk}"


def chunk_record(storage: Storage, manifest: Manifest, indexes: dict[int, Index], read: ChunkRead) -> ChunkRecord:
    rec = indexes[read.file].get((read.entry.name, read.chunk))
    if rec is not None and rec.codec != ZSTD_PLANES and rec.length == read.region.numel * itemsize(read.entry.dtype):
        return rec  # (the common row: what record_problem finds of it)
    problem = record_problem(rec, read.entry, read.region)
    if problem:
        raise CorruptCheckpointError(f"{chunk_where(storage, manifest, read.file, read.entry.name, read.chunk)} "
                                     f"{problem}")
    return rec


def _dense(view: StridedView, numel: int) -> bool:
    """Whether ``view`` is elements ``[0, numel)`` of its buffer in order."""
    if view.offset != 0 or math.prod(view.size) != numel:
        return False
    expected = 1
    for size, stride in zip(reversed(view.size), reversed(view.stride)):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _direct_destination(read: ChunkRead) -> torch.Tensor | None:
    """The target memory the chunk's elements ``[lo, hi)`` can be read into as stored, if there is one."""
    if len(read.copies) != 1:
        return None
    piece, target = read.copies[0]
    if not target.as_stored:  # (another device or dtype, or a lazily conjugated/negated view: copy_ resolves them)
        return None
    shape = read.entry.shape
    if not _dense(strided_view(piece, read.region, shape, base=read.lo), read.hi - read.lo):
        return None
    view = view_of(target.flat, strided_view(piece, target.region, shape))
    return view if view.is_contiguous() else None


class Scratch:
    """One buffer that a lane's reads take in turn: a fresh one per piece would pile up in malloc's arenas."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, *sizes: int) -> list[torch.Tensor]:
        """Consecutive uint8 buffers of ``sizes`` bytes, valid until the next ``take``."""
        if self._buf is None or self._buf.numel() < sum(sizes):
            self._buf = torch.empty(sum(sizes), dtype=torch.uint8)
        return list(self._buf[:sum(sizes)].split(sizes))


def _fresh(*sizes: int) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


def execute_read(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, verify: bool,
                 scratch: Scratch | None = None) -> None:
    size = itemsize(read.entry.dtype)
    lo, hi = read.lo * size, read.hi * size
    # Widened to whole blocks to check them, and for a compressed chunk to decode whole frames.
    start, stop = rec.block_bounds(lo, hi) if verify or rec.frames else (lo, hi)
    direct = _direct_destination(read)
    take = scratch.take if scratch is not None else _fresh
    if direct is not None:
        wanted = as_bytes(direct)
        before, after = take(lo - start, stop - hi)
        parts = [before, wanted, after]
    else:
        (buf,) = take(stop - start)
        parts, wanted = [buf], buf[lo - start:hi - start]
    where = chunk_where(storage, manifest, read.file, read.entry.name, read.chunk)
    read_span(StoredChunk(storage, manifest.files[read.file].path, rec, size, verify, where), start, stop,
              [p.numpy() for p in parts])
    if read.entry.dtype == torch.bool and wanted.numel() and int(wanted.max()) > 1:
        raise CorruptCheckpointError(f"{where} holds a bool byte other than 0 or 1; run `shardckpt verify`")
    if direct is not None:
        return
    if (lo - start) % size:  # a block size that is not a multiple of the item size (another writer's)
        wanted = wanted.clone()
    src_all = from_bytes(wanted, read.entry.dtype, (read.hi - read.lo,))
    shape = read.entry.shape
    for piece, target in read.copies:
        src = view_of(src_all, strided_view(piece, read.region, shape, base=read.lo))
        copy_into(view_of(target.flat, strided_view(piece, target.region, shape)), src)


def execute_reads(storage: Storage, manifest: Manifest, reads: list[ChunkRead], io_threads: int,
                  verify: bool, indexes: Indexes | None = None) -> None:
    """Read ``reads`` (``indexes``: the generation's parsed indexes, kept by the reader between reads)."""
    files = {r.file for r in reads}
    # Open every data file first: a concurrent overwrite may delete them once a new manifest is committed.
    lifecycle(storage).pin([manifest.files[f].path for f in sorted(files)])
    try:
        found = (indexes or Indexes(storage, manifest)).of(files, io_threads)
        _execute(storage, manifest, reads, found, io_threads, verify)
    finally:
        lifecycle(storage).release()


def _execute(storage: Storage, manifest: Manifest, reads: list[ChunkRead], indexes: dict[int, Index],
             io_threads: int, verify: bool) -> None:
    records = [chunk_record(storage, manifest, indexes, r) for r in reads]
    streamed = _streamed_files(storage, manifest, reads, records)
    # The lanes of streamed files first (few, long), then the other reads, biggest first, so that the tail is short.
    tasks = [lambda lane=lane: _read_lane(storage, manifest, lane, verify)
             for lane in _lanes(storage, manifest, reads, records, streamed)]
    rest = [i for i, r in enumerate(reads) if r.file not in streamed]
    spans, rest = small_spans(reads, records, rest)
    tasks += [lambda span=span: _read_small(storage, manifest, reads, records, span, verify) for span in spans]
    for batch in _batches(reads, records, rest, io_threads):
        tasks.append(lambda batch=batch: _read_batch(storage, manifest, reads, records, batch, verify))
    # Every lane in flight at once: a lane is one GET, and the storage said how many suit it.
    threads = max(1, io_threads, min(len(tasks), getattr(storage, "stream_lanes", 0) if streamed else 0))
    if len(tasks) == 1 or one_thread_suits(storage, sum(r.stored_length for r in records)):
        # one small read (a reader reading tensor by tensor), or few bytes on local disk: no pool to start and join
        for task in tasks:
            task()
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="shardckpt-read") as pool:
            list(pool.map(lambda task: task(), tasks))
    if verify:
        check_whole_tensors(reads, records, storage.url(MANIFEST_NAME))


def _batches(reads: list[ChunkRead], records: list[ChunkRecord], which: list[int], io_threads: int) -> list[list[int]]:
    """The reads of ``which`` as tasks, biggest first (so that the tail is short): consecutive chunks of one file
    together, up to ``BATCH_BYTES`` (at most half of each thread's share), so that an incremental checkpoint's
    4 MiB units cost a thread pool no more handoffs than a standalone checkpoint's whole tensors."""
    size = {i: reads[i].hi - reads[i].lo for i in which}
    bytes_of = {i: size[i] * itemsize(reads[i].entry.dtype) for i in which}
    limit = min(BATCH_BYTES, sum(bytes_of.values()) // max(1, 2 * io_threads))
    batches: list[list[int]] = []
    total = 0
    for i in sorted(which, key=lambda i: (reads[i].file, records[i].offset)):
        if batches and reads[batches[-1][-1]].file == reads[i].file and total + bytes_of[i] <= limit:
            batches[-1].append(i)
            total += bytes_of[i]
        else:
            batches.append([i])
            total = bytes_of[i]
    return sorted(batches, key=lambda b: -sum(bytes_of[i] for i in b))


def _read_batch(storage: Storage, manifest: Manifest, reads: list[ChunkRead], records: list[ChunkRecord],
                batch: list[int], verify: bool) -> None:
    """One task's reads (one file, in file order): runs of whole raw chunks that lie back to back in the file and
    in their destination (an incremental checkpoint's units of one tensor) with one ranged read each, checked chunk
    by chunk; the other reads one by one."""
    run: list[tuple[int, torch.Tensor]] = []
    for i in batch + [None]:
        direct = _whole_direct(reads[i], records[i]) if i is not None else None
        if run and direct is not None and _follows(records[run[-1][0]], run[-1][1], records[i], direct):
            run.append((i, direct))
            continue
        if len(run) > 1:
            _read_run(storage, manifest, reads, records, run, verify)
        elif run:
            execute_read(storage, manifest, reads[run[0][0]], records[run[0][0]], verify)
        if i is not None and direct is None:
            execute_read(storage, manifest, reads[i], records[i], verify)
        run = [(i, direct)] if direct is not None else []


def _whole_direct(read: ChunkRead, rec: ChunkRecord) -> torch.Tensor | None:
    """The destination of a read of a whole raw chunk, if its bytes can go there as stored."""
    if rec.frames or read.lo != 0 or read.hi * itemsize(read.entry.dtype) != rec.length:
        return None
    return _direct_destination(read)


def _follows(rec: ChunkRecord, dest: torch.Tensor, next_rec: ChunkRecord, next_dest: torch.Tensor) -> bool:
    return (next_rec.offset == rec.offset + rec.length
            and next_dest.untyped_storage().data_ptr() == dest.untyped_storage().data_ptr()
            and next_dest.data_ptr() == dest.data_ptr() + dest.nbytes)


def _read_run(storage: Storage, manifest: Manifest, reads: list[ChunkRead], records: list[ChunkRecord],
              run: list[tuple[int, torch.Tensor]], verify: bool) -> None:
    """Chunks back to back in one file and in one destination: one read into the destination, then each chunk's
    blocks checked (and a bool chunk's bytes) as ``execute_read`` checks them."""
    first = run[0][1]
    memory = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    at = first.data_ptr() - first.untyped_storage().data_ptr()
    total = sum(d.nbytes for _, d in run)
    span = memory[at:at + total]
    if span.numel() != total:  # the next destinations are past the first one's storage (another storage that
        for i, _ in run:       # starts at the same address): one read each
            execute_read(storage, manifest, reads[i], records[i], verify)
        return
    storage.read_into(manifest.files[reads[run[0][0]].file].path, records[run[0][0]].offset, memoryview(span.numpy()))
    for i, dest in run:
        read, rec = reads[i], records[i]
        where = chunk_where(storage, manifest, read.file, read.entry.name, read.chunk)
        wanted = as_bytes(dest)
        if verify:
            check_raw_blocks(rec, 0, rec.length, [wanted.numpy()], where)
        if read.entry.dtype == torch.bool and wanted.numel() and int(wanted.max()) > 1:
            raise CorruptCheckpointError(f"{where} holds a bool byte other than 0 or 1; run `shardckpt verify`")


def _streamed_files(storage: Storage, manifest: Manifest, reads: list[ChunkRead], records: list[ChunkRecord],
                    ) -> dict[int, list[int]]:
    """The files to read through streaming GETs, with their reads in file order: on storages that stream
    (object stores), the files whose reads cover at least ``STREAM_FRACTION`` of their bytes."""
    if not getattr(storage, "streams_whole_files", False):
        return {}
    by_file: dict[int, list[int]] = {}
    for i, r in enumerate(reads):
        by_file.setdefault(r.file, []).append(i)
    return {f: sorted(idx, key=lambda i: (records[i].offset, reads[i].lo)) for f, idx in by_file.items()
            if sum(records[i].stored_length for i in idx) >= STREAM_FRACTION * manifest.files[f].size}


def _lanes(storage: Storage, manifest: Manifest, reads: list[ChunkRead], records: list[ChunkRecord],
           streamed: dict[int, list[int]]) -> list[tuple[str, list[Piece]]]:
    """The streamed files' reads, big ones cut into pieces, as lanes (``lanes.py``): ``stream_lanes`` of them
    shared among the files by their bytes, each lane with its file's path."""
    pieces = {f: [Piece(part, records[i], *stored_span(part, records[i])) for i in idx
                  for part in cut_read(reads[i], records[i])] for f, idx in streamed.items()}
    counts = share({f: sum(p.stop - p.start for p in ps) for f, ps in pieces.items()},
                   getattr(storage, "stream_lanes", 1))
    return [(manifest.files[f].path, lane) for f, ps in pieces.items() for lane in lanes(ps, counts[f])]


def _read_lane(storage: Storage, manifest: Manifest, lane: tuple[str, list[Piece]], verify: bool) -> None:
    path, pieces = lane
    scratch = Scratch()
    with storage.stream(path, pieces[0].start, max(p.stop for p in pieces)) as stream:
        for p in pieces:
            execute_read(stream, manifest, p.read, p.rec, verify, scratch)


def small_spans(reads: list[ChunkRead], records: list[ChunkRecord], which: list[int],
                ) -> tuple[list[list[int]], list[int]]:
    """The reads of small chunks (at most ``SMALL_CHUNK`` stored bytes) grouped into runs of one file, in file
    order (``close_runs``): one ranged read per run instead of one per chunk (many small tensors). The other reads
    are returned apart."""
    small = sorted((i for i in which if records[i].stored_length <= SMALL_CHUNK),
                   key=lambda i: (reads[i].file, records[i].offset))
    runs = close_runs([(reads[i].file, records[i].offset, records[i].offset + records[i].stored_length)
                       for i in small])
    spans = [[small[j] for j in run] for run in runs]
    large = [i for i in which if records[i].stored_length > SMALL_CHUNK]
    return [span for span in spans if len(span) > 1], large + [span[0] for span in spans if len(span) == 1]


def close_runs(spans: list[tuple[int, int, int]]) -> list[list[int]]:
    """The positions of ``spans`` (file, first byte, end; in file order) grouped into runs of one file, each at most
    ``SPAN_BYTES`` from its first byte to its last and with gaps of at most ``SPAN_GAP``: one ranged read each."""
    runs: list[list[int]] = []
    start = end = -1
    for k, (f, a, b) in enumerate(spans):
        if runs and spans[runs[-1][0]][0] == f and a - end <= SPAN_GAP and b - start <= SPAN_BYTES:
            runs[-1].append(k)
            end = max(end, b)
        else:
            runs.append([k])
            start, end = a, b
    return runs


class Window:
    """Bytes ``[start, start + len(data))`` of one data file, read once into ``data``, served to ``read_span`` as a
    storage; ``address``: where its first byte is (small chunks are copied from there)."""

    def __init__(self, storage: Storage, path: str, start: int, data: bytearray):
        self.storage, self.path, self.start, self.buf = storage, path, start, memoryview(data)
        storage.read_into(path, start, self.buf)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(data)) if data else 0

    def url(self, path: str) -> str:
        return self.storage.url(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        lo = offset - self.start
        if path != self.path or lo < 0 or lo + len(out) > len(self.buf):
            raise ValueError(f"read of {path} [{offset}, {offset + len(out)}) outside the window")  # a bug, not input
        out[:] = self.buf[lo:lo + len(out)]


def _read_small(storage: Storage, manifest: Manifest, reads: list[ChunkRead], records: list[ChunkRecord],
                span: list[int], verify: bool) -> None:
    """One run of ``small_spans``: one ranged read, then each chunk from memory, every one checked as before."""
    path = manifest.files[reads[span[0]].file].path
    start = records[span[0]].offset
    stop = max(records[i].offset + records[i].stored_length for i in span)
    window = Window(storage, path, start, bytearray(stop - start))
    for i in span:
        if not _copy_small_chunk(window, reads[i], records[i], verify):
            execute_read(window, manifest, reads[i], records[i], verify)


def _copy_small_chunk(window: Window, read: ChunkRead, rec: ChunkRecord, verify: bool) -> bool:
    """The common cases of a small chunk, without ``execute_read``'s general machinery: a raw one-block chunk
    whose every copy fills one CPU target of its dtype exactly with elements in the chunk's order: the whole
    chunk, or (a reshard of a flat chunk: ``convert``) a run of it. False: not such a case, or its block's
    checksum fails (then ``execute_read`` reads it again and reports the failing block as always)."""
    if rec.frames or len(rec.blocks) != 1 or read.entry.dtype == torch.bool:
        return False
    size = itemsize(read.entry.dtype)
    spans = [_span_in_chunk(read, piece, target) for piece, target in read.copies]
    if None in spans:
        return False
    at = rec.offset - window.start
    if verify and crc32c(window.buf[at:at + rec.length]) != rec.blocks[0]:
        return False
    for (lo, hi), (_, target) in zip(spans, read.copies):  # (checked above: a plain CPU target of these bytes)
        ctypes.memmove(target.dest.data_ptr(), window.address + at + lo * size, (hi - lo) * size)
    return True


def _span_in_chunk(read: ChunkRead, piece, target: CheckedRequest) -> tuple[int, int] | None:
    """Elements ``[lo, hi)`` of the read's chunk that ``piece`` is, in the chunk's (stored) order, where the piece is
    the whole of the target's region and the target takes stored bytes as they are (its destination then holds the
    region's elements, contiguous: ``check_request``); else None."""
    # (``is`` first: a whole tensor's plan hands the one region object round, and a dataclass's == costs 0.5 us)
    if not target.as_stored or (target.region is not piece and target.region != piece):
        return None
    if piece is read.region or piece == read.region:
        return 0, piece.numel
    if isinstance(piece, FlatRange) and isinstance(read.region, FlatRange):
        return piece.start - read.region.start, piece.stop - read.region.start
    return None
