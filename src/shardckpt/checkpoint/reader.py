"""Executing a read plan: fetch the chunk indexes needed, then ranged-read chunk bytes on a thread pool.

When a read covers a whole chunk that lands contiguously in a CPU target of the same dtype, the bytes
are read straight into the target's memory (no intermediate buffer); otherwise into a buffer of just
the needed span, then copied piece by piece (any device, any dtype cast).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from shardckpt.checkpoint.load_plan import ChunkRead
from shardckpt.errors import CorruptCheckpointError
from shardckpt.regions import strided_view
from shardckpt.storage.backend import Storage
from shardckpt.storage.checksum import crc32c
from shardckpt.storage.dtypes import itemsize
from shardckpt.storage.manifest import ChunkRecord, FileEntry, Manifest, parse_index
from shardckpt.tensor_views import as_bytes, from_bytes, view_of

Index = dict[tuple[str, int], ChunkRecord]


def check_data_file(storage: Storage, file: FileEntry) -> None:
    """The data file must have the size the manifest records (catches truncation and lying manifests early)."""
    size = storage.file_size(file.path)
    if size != file.size:
        raise CorruptCheckpointError(f"{storage.url(file.path)}: data file has {size} bytes, the manifest records "
                                     f"{file.size}")


def read_index(storage: Storage, file: FileEntry) -> Index:
    """A data file's chunk index, checked against the size and CRC the manifest recorded for it."""
    check_data_file(storage, file)
    url = storage.url(file.index_path)
    data = storage.read_bytes(file.index_path)
    if len(data) != file.index_size or crc32c(data) != file.index_crc32c:
        raise CorruptCheckpointError(f"{url}: chunk index is damaged (size or checksum differs from the manifest)")
    return parse_index(data, file, url)


def read_indexes(storage: Storage, manifest: Manifest, files: set[int], pool: ThreadPoolExecutor) -> dict[int, Index]:
    ordered = sorted(files)
    return dict(zip(ordered, pool.map(lambda f: read_index(storage, manifest.files[f]), ordered)))


def chunk_record(storage: Storage, manifest: Manifest, indexes: dict[int, Index], read: ChunkRead) -> ChunkRecord:
    file = manifest.files[read.file]
    rec = indexes[read.file].get((read.entry.name, read.chunk))
    where = f"{storage.url(file.path)}: tensor {read.entry.name!r} chunk {read.chunk}"
    if rec is None:
        raise CorruptCheckpointError(f"{where} is missing from the file's index")
    if rec.length != read.region.numel * itemsize(read.entry.dtype):
        raise CorruptCheckpointError(f"{where} has {rec.length} bytes, its region needs "
                                     f"{read.region.numel * itemsize(read.entry.dtype)}")
    return rec


def _direct_destination(read: ChunkRead) -> torch.Tensor | None:
    """The target memory this whole chunk can be read into as is, if there is one."""
    if len(read.copies) != 1 or read.lo != 0 or read.hi != read.region.numel:
        return None
    piece, target = read.copies[0]
    if piece != read.region or target.flat.device.type != "cpu" or target.flat.dtype != read.entry.dtype:
        return None
    view = view_of(target.flat, strided_view(piece, target.region, read.entry.shape))
    return view if view.is_contiguous() else None


def _check(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, data) -> None:
    got = crc32c(data)
    if got != rec.crc32c:
        url = storage.url(manifest.files[read.file].path)
        raise CorruptCheckpointError(f"{url}: tensor {read.entry.name!r} chunk {read.chunk} fails its checksum "
                                     f"(stored {rec.crc32c:08x}, read {got:08x}); run `shardckpt verify`")


def execute_read(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, verify: bool) -> None:
    path = manifest.files[read.file].path
    size = itemsize(read.entry.dtype)
    whole = read.lo == 0 and read.hi == read.region.numel
    direct = _direct_destination(read)
    if direct is not None:
        out = as_bytes(direct).numpy()
        storage.read_into(path, rec.offset, memoryview(out))
        if verify:
            _check(storage, manifest, read, rec, out)
        return
    buf = torch.empty((read.hi - read.lo) * size, dtype=torch.uint8)
    storage.read_into(path, rec.offset + read.lo * size, memoryview(buf.numpy()))
    if verify and whole:
        _check(storage, manifest, read, rec, buf.numpy())
    src_all = from_bytes(buf, read.entry.dtype, (read.hi - read.lo,))
    shape = read.entry.shape
    for piece, target in read.copies:
        src = view_of(src_all, strided_view(piece, read.region, shape, base=read.lo))
        view_of(target.flat, strided_view(piece, target.region, shape)).copy_(src)


def execute_reads(storage: Storage, manifest: Manifest, reads: list[ChunkRead], io_threads: int,
                  verify: bool) -> None:
    files = {r.file for r in reads}
    # Open every data file first: a concurrent overwrite may delete them once a new manifest is committed.
    storage.pin([manifest.files[f].path for f in sorted(files)])
    try:
        _execute(storage, manifest, reads, files, io_threads, verify)
    finally:
        storage.release()


def _execute(storage: Storage, manifest: Manifest, reads: list[ChunkRead], files: set[int], io_threads: int,
             verify: bool) -> None:
    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-read") as pool:
        indexes = read_indexes(storage, manifest, files, pool)
        records = [chunk_record(storage, manifest, indexes, r) for r in reads]
        # Biggest reads first, so that the pool's tail is short.
        order = sorted(range(len(reads)), key=lambda i: -(reads[i].hi - reads[i].lo))
        list(pool.map(lambda i: execute_read(storage, manifest, reads[i], records[i], verify), order))
