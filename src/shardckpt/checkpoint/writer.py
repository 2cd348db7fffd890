"""Writing one rank's data files from staged host buffers: checksum each block, write it, make the files durable.

The pieces come from ``checkpoint.stage``: their ``data`` is a contiguous CPU tensor, which this module writes as
it is, or a CUDA tensor a synchronous save kept on its device, copied to the host a slice at a time under the
writes (``checkpoint.device_slices``). Each block's CRC32C is computed just before the block is written, while its
bytes are in cache; a call to the storage writer covers ``WRITE_SIZE`` bytes (whole blocks). With
compression, each block is encoded as one frame on ``format.codecs.codec_pool`` (its CRC taken in the same
task), a bounded number of frames ahead of the writes, so that encoding overlaps writing.

A data file's writing can be followed and taken up again (``convert``'s resume): ``FileProgress`` says how far
it has come (the finished chunks' records, the block CRCs and frames of the chunk in progress, the bytes
written), a ``journal`` callback sees it after every write, and ``write_data_file(start=...)`` goes on from a
progress whose bytes a caller has checked, with a writer that keeps them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.device_slices import device_slices
from shardckpt.checkpoint.persist import write_files, writer_threads
from shardckpt.checkpoint.progress import Progress, ProgressCallback
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.regions import FlatRange, contiguous_runs
from shardckpt.io import FileWriter, Storage
from shardckpt.format.codecs import CODEC_THREADS, RAW, Compression, codec_pool, encode_frame
from shardckpt.format.checksum import combine_block_crcs, crc32c, runs_crc_term, tensor_crc_term, xor_terms
from shardckpt.format.content_hash import ChunkHasher
from shardckpt.format.index import BLOCK_SIZE, ChunkRecord, index_to_bytes
from shardckpt.format.manifest import FileEntry, version_for
from shardckpt.tensor_views import as_bytes, host_memory
from shardckpt.records import record

ALIGN = 64  # chunk offsets are aligned so that a memory map of the file gives aligned tensors
WRITE_SIZE = 16 << 20  # bytes written per call (16 checksum blocks, each CRC'd just before, while in cache)
SMALL_WRITE = 64 << 10  # writes shorter than this are gathered (``_Coalesced``) ...
COALESCE_BYTES = 4 << 20  # ... and written once this many bytes are gathered
_ZEROS = memoryview(bytes(ALIGN))  # alignment padding


@record
class StreamedPiece:
    """A chunk written as it is produced, a slice at a time, so that it never needs to be in memory whole
    (``convert``: memory bounded whatever the chunk's size).

    ``slices(block, first)`` yields the chunk's elements from its ``first`` on, in order, as contiguous CPU
    tensors of ``dtype``, each a whole number of ``block`` bytes (the checksum block) but the last. The region is
    one contiguous run of the tensor, so that the chunk's checksum term follows from its block CRCs alone."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    region: FlatRange
    slices: Callable[[int, int], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.dtype.itemsize


@record
class HeldPiece:
    """A small raw chunk whose bytes are in host memory when the piece is asked for and stay there only until the
    next piece of its file is (``convert``'s small chunks, read in runs: ``offline.streams.FileRuns``): written at
    once, a few operations per chunk. ``data``: its bytes as stored; ``slices`` as a ``StreamedPiece``'s."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    region: FlatRange
    data: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def slices(self, block: int, first: int) -> Iterator[torch.Tensor]:
        rest = self.data[first * self.dtype.itemsize:]
        if len(rest):
            yield torch.frombuffer(rest, dtype=torch.uint8)


Piece = Union[LocalPiece, StreamedPiece, HeldPiece]


@dataclass
class FileProgress:
    """How far the writing of one data file has come: ``done``, the finished chunks' records (placed, in write
    order); ``current``, the chunk being written (or None), with the CRCs of its ``blocks`` written so far and
    their stored ``frames`` (compressed chunks); ``size``, the bytes written, up to the end of the last block."""

    done: dict[tuple[str, int], ChunkRecord] = dataclasses.field(default_factory=dict)
    current: tuple[str, int] | None = None
    offset: int = 0  # where the current chunk starts
    blocks: list[int] = dataclasses.field(default_factory=list)
    frames: list[int] = dataclasses.field(default_factory=list)
    size: int = 0


Journal = Callable[[FileProgress], None]
Tick = Callable[[int], None]  # told the tensor bytes of each write (``checkpoint.progress.Progress``)


@dataclass(frozen=True)
class RankResult:
    files: list[FileEntry]  # one per slot, in slot order
    crc_terms: dict[str, int]  # per tensor: XOR of this rank's chunks' checksum terms
    version: int | None = None  # the format version of the indexes written (None: not told)


def _staged(piece: LocalPiece) -> torch.Tensor:
    """The piece's staged host tensor (see ``checkpoint.stage``), refused if it is not one."""
    t = piece.data
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise ValueError(f"{piece.name!r} is not staged: its data must be a contiguous CPU tensor without "
                         "conj/neg bits (checkpoint.stage.stage makes them)")
    return t


def _crc_term(piece: Piece, size: int, crc: int, raw: torch.Tensor | None) -> int:
    """This chunk's term of the tensor checksum (see format.checksum): box chunks have one run per row (a
    ``LocalPiece`` only: its ``raw`` bytes give each run's CRC)."""
    region = piece.region
    if type(region) is FlatRange:  # one run (every streamed piece): its CRC shifted past the bytes after it
        return tensor_crc_term(crc, (math.prod(piece.shape) - region.stop) * size) if region.numel else 0
    runs = list(contiguous_runs(region, piece.shape))
    if len(runs) == 1:
        crcs = [crc]
    else:
        buf = host_memory(raw)
        crcs = [crc32c(buf[local * size:(local + n) * size]) for _, local, n in runs]
    return runs_crc_term(runs, crcs, size, math.prod(piece.shape))


chunk_crc_term = _crc_term  # an incremental save's term of a chunk it references instead of writing


@dataclass
class _Sink:
    """Where a data file's chunks go: its writer, the progress of its writing, and who is told of each write."""

    writer: FileWriter
    progress: FileProgress
    journal: Journal
    tick: Tick
    hasher: ChunkHasher | None = None  # the chunk being written's content hash (an incremental save's unit)

    def write(self, data: memoryview) -> None:
        self.writer.write(data)

    def wrote(self, crc: int, stored: int, logical: int, frame: bool) -> None:
        """One block (``frame``: one encoded frame) written: ``stored`` bytes of ``logical`` tensor bytes."""
        self.progress.blocks.append(crc)
        if frame:
            self.progress.frames.append(stored)
        self.progress.size += stored
        self.journal(self.progress)
        self.tick(logical)


def _write_raw(sink: _Sink, data: memoryview, block: int) -> None:
    """Write a chunk's bytes as they are, ``WRITE_SIZE`` at a time, adding its block CRCs to the progress."""
    step = max(WRITE_SIZE // block, 1) * block  # writes end on block boundaries
    progress = sink.progress
    for lo in range(0, len(data), step):
        part = data[lo:lo + step]
        if sink.hasher is not None:  # CRC'd, hashed and written from one copy: a caller's thread writing the
            part = memoryview(bytes(part))  # tensor meanwhile changes the digest (caught), never the CRCs alone
            sink.hasher.update(part)
        crcs = [crc32c(part[k:k + block]) for k in range(0, len(part), block)]
        sink.write(part)
        progress.blocks.extend(crcs)
        progress.size += len(part)
        sink.journal(progress)
        sink.tick(len(part))


def _write_frames(sink: _Sink, data: memoryview, block: int, codec: str, itemsize: int, level: int) -> None:
    """Encode and write a chunk frame by frame, adding its block CRCs and frames' stored lengths to the progress."""
    pool = codec_pool()

    def encode(lo: int) -> tuple[int, memoryview, int, bytes | None]:
        frame = data[lo:lo + block]
        if sink.hasher is not None:  # hashed in order below: from this copy, the bytes encoded and CRC'd
            frame = memoryview(bytes(frame))  # (a view: a frame the codec cannot shrink is written as it is)
        return crc32c(frame), encode_frame(codec, frame, itemsize, level), len(frame), \
            frame if sink.hasher is not None else None

    starts = iter(range(0, len(data), block))
    # Frames encoded ahead of the writes, in order: enough to keep every codec thread busy, few enough
    # that memory stays a few blocks.
    pending = deque(pool.submit(encode, lo) for lo in itertools.islice(starts, 2 * CODEC_THREADS))
    while pending:
        crc, stored, length, copy = pending.popleft().result()
        for lo in itertools.islice(starts, 1):
            pending.append(pool.submit(encode, lo))
        if copy is not None:
            sink.hasher.update(copy)
        sink.write(stored)
        sink.wrote(crc, len(stored), length, frame=True)


def _write_chunk(sink: _Sink, piece: Piece, compression: Compression | None) -> tuple[ChunkRecord, int]:
    """Stream one chunk, each block checksummed just before it is written (while it is in cache), encoded
    as a frame if ``compression``; a chunk none of whose frames shrank is recorded as ``raw``. A streamed
    chunk goes on after the blocks the progress already has of it (``current``).

    Returns the record (at ``progress.offset``) and the chunk's term of the tensor checksum."""
    block = BLOCK_SIZE  # read at call time: tests shrink it to get many blocks from small tensors
    progress = sink.progress
    kept = len(progress.blocks) * block
    if compression is None and not kept and isinstance(piece, LocalPiece) and \
            0 < piece.data.nbytes <= min(block, SMALL_WRITE) and piece.data.is_cpu:
        return _write_one_block(sink, piece, _staged(piece), piece.data.dtype.itemsize, block)
    if compression is None and not kept and isinstance(piece, StreamedPiece) and \
            0 < piece.nbytes <= min(block, SMALL_WRITE):
        return _write_streamed_block(sink, piece, block)
    if isinstance(piece, (StreamedPiece, HeldPiece)):
        raw, dtype, slices = None, piece.dtype, piece.slices(block, kept // piece.dtype.itemsize)
    elif piece.data.device.type != "cpu":  # kept on its device by a synchronous save (``checkpoint.device_slices``)
        raw, dtype = None, piece.data.dtype
        slices = device_slices(piece.data)(block, kept // dtype.itemsize)
    else:
        raw = as_bytes(_staged(piece))
        dtype, slices = piece.data.dtype, iter([raw])  # (flat uint8 already: as_bytes below returns it as it is)
    codec = RAW if compression is None else compression.codec_for(dtype)
    length = kept
    with contextlib.closing(slices) if hasattr(slices, "close") else contextlib.nullcontext():
        # (closed at once on a failure: a slice generator holds its buffer until it ends)
        for part in map(as_bytes, slices):
            if length % block:
                raise ValueError(f"{piece.name!r}: a slice before the last ends mid-block ({length} bytes written, "
                                 f"blocks of {block})")
            data = host_memory(part)  # (not .numpy(): that would pin the caller's storage size)
            if codec == RAW:
                _write_raw(sink, data, block)
            else:
                _write_frames(sink, data, block, codec, dtype.itemsize, compression.level)
            length += len(data)
    frames = progress.frames
    if codec != RAW and sum(frames) >= length:
        codec = RAW  # every frame was stored as it is: the stored bytes are the raw chunk
    crc = combine_block_crcs(progress.blocks, length, block)
    record = ChunkRecord(progress.offset, length, crc, codec, block, tuple(progress.blocks),
                         tuple(frames) if codec != RAW else ())
    return record, _crc_term(piece, dtype.itemsize, crc, raw)


def _write_one_block(sink: _Sink, piece: Piece, raw: torch.Tensor, itemsize: int, block: int
                     ) -> tuple[ChunkRecord, int]:
    """``_write_chunk`` of a small raw chunk of one block, its bytes those of ``raw`` (a contiguous host tensor of
    any dtype and shape; the chunks the writes gather), without its general machinery: the same bytes, CRC, record
    and term, a few microseconds per chunk."""
    data = host_memory(raw)
    crc = crc32c(data)
    if sink.hasher is not None:
        sink.hasher.update(data)
    sink.write(data)
    progress = sink.progress
    progress.blocks.append(crc)
    progress.size += len(data)
    sink.journal(progress)
    sink.tick(len(data))
    record = ChunkRecord(progress.offset, len(data), crc, RAW, block, (crc,), ())
    return record, _crc_term(piece, itemsize, crc, raw)


def _write_small(sink: _Sink, small: list[tuple[tuple[str, int], LocalPiece | HeldPiece]],
                 terms: dict[str, int]) -> None:
    """``_write_chunk`` of each of consecutive small staged or held chunks (raw, one block each, none hashed, on the
    host), emptying ``small``: the same bytes, records and terms, in one loop instead of a few calls per chunk (a save
    or a conversion of many small tensors)."""
    progress, write, done = sink.progress, sink.writer.write, sink.progress.done
    size, written, block = progress.size, 0, BLOCK_SIZE
    for key, piece in small:
        if type(piece) is HeldPiece:
            raw, data, itemsize = None, piece.data, piece.dtype.itemsize  # (one run: its term needs no bytes)
        else:
            raw = _staged(piece)
            data, itemsize = host_memory(raw), raw.dtype.itemsize
        pad = -size % ALIGN
        if pad:
            write(_ZEROS[:pad])
            size += pad
        crc = crc32c(data)
        write(data)
        done[key] = ChunkRecord(size, len(data), crc, RAW, block, (crc,), ())
        size += len(data)
        written += len(data)
        terms[key[0]] = terms.get(key[0], 0) ^ _crc_term(piece, itemsize, crc, raw)
    progress.size, progress.current = size, None
    small.clear()
    sink.journal(progress)
    sink.tick(written)


def _write_streamed_block(sink: _Sink, piece: StreamedPiece, block: int) -> tuple[ChunkRecord, int]:
    """``_write_one_block`` of a streamed chunk of one block: its one slice (``convert``'s small chunks)."""
    nbytes = piece.nbytes
    slices = piece.slices(block, 0)
    try:
        first = next(slices, None)
        raw = as_bytes(first) if first is not None else torch.empty(0, dtype=torch.uint8)
        if raw.numel() != nbytes:
            raise ValueError(f"{piece.name!r}: its first slice holds {raw.numel()} bytes, not its {nbytes}")
        return _write_one_block(sink, piece, raw, piece.dtype.itemsize, block)
    finally:
        getattr(slices, "close", lambda: None)()  # the slice's buffer goes back once its bytes are written


@dataclass(frozen=True)
class Followed:
    """How the writing of one data file is followed and taken up again (``convert``'s resume, progress):
    ``start``, the progress of an earlier writing of this same file whose bytes are checked and kept (streamed
    pieces only), ``writer`` then writing after them; ``journal(progress)`` called after a write whenever all that
    the progress counts is in the file (small chunks are gathered into writes of ``COALESCE_BYTES``: the journal
    hears of them once that is written); ``tick(n)`` after every write, with its tensor bytes."""

    start: FileProgress | None = None
    writer: FileWriter | None = None
    journal: Journal | None = None
    tick: Tick | None = None
    records: dict | None = None  # filled with each hashed chunk's record (its digest set), by (name, chunk)
    indexed: Callable[[bytes], None] | None = None  # told the index's bytes once they are written (a journal's)


def write_data_file(storage: Storage, data_path: str, index_path: str, tasks: list[WriteTask],
                    pieces: dict[str, Piece], compression: Compression | None = None, *,
                    version: int | None = None, followed: Followed = Followed()) -> tuple[FileEntry, dict[str, int]]:
    """Write the tasks' chunks in order (offsets aligned) and the file's index; both durable on return.

    ``pieces``: by name, staged pieces (``Staged.pieces``) or streamed ones. ``version``: the manifest's format
    version, which the index carries (default: ``version_for`` the compression). ``followed``: see ``Followed``."""
    progress = followed.start if followed.start is not None else FileProgress()
    writer = _Coalesced(followed.writer or storage.open_writer(data_path))
    journal = followed.journal
    # The journal hears of the progress only when all of it is in the file, none still gathered (a resume checks the
    # bytes it claims; a claim ahead of the file would only be written again).
    sink = _Sink(writer, progress, (lambda p: None if writer.pending else journal(p)) if journal else lambda p: None,
                 followed.tick or (lambda n: None))
    terms: dict[str, int] = {}
    small: list[tuple[tuple[str, int], LocalPiece]] = []  # consecutive small staged chunks, written together
    limit = min(BLOCK_SIZE, SMALL_WRITE)
    try:
        for task in tasks:
            key = (task.name, task.chunk)
            piece = pieces[key] if key in pieces else pieces[task.name]  # by key: an incremental save's units
            kind = type(piece)
            if compression is None and progress.current != key and key not in progress.done and (
                    kind is LocalPiece and 0 < piece.data.nbytes <= limit and piece.data.is_cpu or
                    kind is HeldPiece and piece.nbytes <= limit):
                small.append((key, piece))
                if kind is HeldPiece:  # written now: its bytes may be another's once the next piece is asked for
                    _write_small(sink, small, terms)
                continue
            if small:
                _write_small(sink, small, terms)
            if key in progress.done:  # kept: a streamed chunk is one run, its term follows from its CRC
                terms[task.name] = terms.get(task.name, 0) ^ _crc_term(piece, piece.dtype.itemsize,
                                                                       progress.done[key].crc32c, None)
                continue
            if progress.current != key:
                pad = -progress.size % ALIGN
                if pad:
                    writer.write(_ZEROS[:pad])
                progress.current, progress.offset, progress.blocks, progress.frames = key, progress.size + pad, [], []
                progress.size += pad
            sink.hasher = ChunkHasher(piece.hash_key) if getattr(piece, "hash_key", None) is not None else None
            record, term = _write_chunk(sink, piece, compression)
            if sink.hasher is not None:  # format v5: the unit's content hash, of the bytes written (incremental)
                record = dataclasses.replace(record, digest=sink.hasher.digest())
                if followed.records is not None:
                    followed.records[key] = record
            progress.done[key], progress.current = record, None
            terms[task.name] = terms.get(task.name, 0) ^ term
        if small:
            _write_small(sink, small, terms)
    finally:
        writer.close()
    index = index_to_bytes(progress.done, version or version_for(compression is not None), BLOCK_SIZE)
    index_writer = storage.open_writer(index_path)
    index_writer.write(memoryview(index))
    index_writer.close()
    if followed.indexed is not None:
        followed.indexed(index)
    return FileEntry(data_path, progress.size, index_path, len(index), crc32c(index)), terms


def gathered_max() -> int:
    """The most bytes one file's gathering (``_Coalesced``) holds: under ``COALESCE_BYTES`` and one small write, and
    a bytearray's growth (1/8) beyond; none where nothing is gathered (``COALESCE_BYTES`` 0, as tests set it)."""
    return (COALESCE_BYTES + SMALL_WRITE) * 9 // 8 if COALESCE_BYTES else 0


class _Coalesced:
    """A file writer that gathers small writes (small chunks and their alignment padding) into one buffer and
    writes it as one: many small tensors cost a write per ``COALESCE_BYTES``, not two per tensor."""

    def __init__(self, writer: FileWriter):
        self._writer, self._buf = writer, bytearray()

    @property
    def pending(self) -> int:
        """Bytes gathered and not yet written."""
        return len(self._buf)

    def write(self, data: memoryview) -> None:
        if len(data) >= SMALL_WRITE:
            self._flush()
            self._writer.write(data)
            return
        self._buf += data
        if len(self._buf) >= COALESCE_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            buf, self._buf = self._buf, bytearray()
            self._writer.write(memoryview(buf))

    def close(self) -> None:
        try:
            self._flush()
        finally:
            self._writer.close()


def write_rank_files(storage: Storage, base: str, tasks: list[WriteTask], pieces: dict[str, Piece],
                     files_per_rank: int, compression: Compression | None = None,
                     version: int | None = None, progress: ProgressCallback | None = None) -> RankResult:
    """One data file per slot (``<base>-<slot>.bin``), written in parallel (``checkpoint.persist.write_files``; one
    after another when they are few bytes on local disk, ``writer_threads``).
    ``progress(done_bytes, total_bytes)``: the tensor bytes of ``tasks`` written (staged pieces only)."""
    by_slot = [[t for t in tasks if t.slot == k] for k in range(files_per_rank)]
    nbytes = sum(pieces[t.name].nbytes for t in tasks)
    tick = Progress(nbytes, progress) if progress is not None else None  # (None: no call per write)
    if tick is not None:
        tick.begin()

    def write(k: int) -> tuple[FileEntry, dict[str, int]]:
        return write_data_file(storage, f"{base}-{k}.bin", f"{base}-{k}.index.json", by_slot[k], pieces, compression,
                               version=version, followed=Followed(tick=tick))

    written = write_files(range(files_per_rank), write, writer_threads(storage, files_per_rank, nbytes))
    return rank_result(written, version or version_for(compression is not None))


def rank_result(written: list[tuple[FileEntry, dict[str, int]]], version: int) -> RankResult:
    """One rank's result from its files' (in slot order): their entries, and each tensor's checksum term."""
    return RankResult([entry for entry, _ in written], xor_terms([terms for _, terms in written]), version)
