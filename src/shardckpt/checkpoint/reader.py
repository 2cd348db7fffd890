"""Executing a read plan: fetch the chunk indexes needed, then ranged-read chunk bytes on a thread pool.

When a read covers a whole chunk that lands contiguously in a CPU target of the same dtype, the bytes
are read straight into the target's memory (no intermediate buffer) and checked against the chunk's
CRC32C. Otherwise the read is widened to whole checksum blocks around the needed span (at most one
extra partial block at each end), every block is checked, and the needed elements are copied piece by
piece (any device, any dtype cast). No byte reaches a caller unchecked while ``verify`` is on.
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
from shardckpt.storage.index import ChunkRecord, parse_index
from shardckpt.storage.manifest import FileEntry, Manifest
from shardckpt.tensor_views import as_bytes, from_bytes, view_of

Index = dict[tuple[str, int], ChunkRecord]


def check_data_file(storage: Storage, file: FileEntry) -> None:
    """The data file must have the size the manifest records (catches truncation and lying manifests early)."""
    size = storage.file_size(file.path)
    if size != file.size:
        raise CorruptCheckpointError(f"{storage.url(file.path)}: data file has {size} bytes, the manifest records "
                                     f"{file.size}")


def read_index(storage: Storage, file: FileEntry, version: int) -> Index:
    """A data file's chunk index, checked against the size and CRC the manifest recorded for it."""
    check_data_file(storage, file)
    url = storage.url(file.index_path)
    data = storage.read_bytes(file.index_path)
    if len(data) != file.index_size or crc32c(data) != file.index_crc32c:
        raise CorruptCheckpointError(f"{url}: chunk index is damaged (size or checksum differs from the manifest)")
    return parse_index(data, version, file.size, url)


def read_indexes(storage: Storage, manifest: Manifest, files: set[int], pool: ThreadPoolExecutor) -> dict[int, Index]:
    ordered = sorted(files)
    return dict(zip(ordered, pool.map(lambda f: read_index(storage, manifest.files[f], manifest.version), ordered)))


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


def _corrupt(storage: Storage, manifest: Manifest, read: ChunkRead, what: str) -> CorruptCheckpointError:
    url = storage.url(manifest.files[read.file].path)
    return CorruptCheckpointError(f"{url}: tensor {read.entry.name!r} chunk {read.chunk} {what}; run "
                                  "`shardckpt verify`")


def _check_chunk(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, data) -> None:
    got = crc32c(data)
    if got != rec.crc32c:
        raise _corrupt(storage, manifest, read, f"fails its checksum (stored {rec.crc32c:08x}, read {got:08x})")


def _check_blocks(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, data, start: int) -> None:
    """``data`` holds the chunk's stored bytes from ``start`` (a block boundary) to a block boundary or its end."""
    b = rec.block_size
    for k, lo in enumerate(range(0, len(data), b), start // b):
        got = crc32c(data[lo:lo + b])
        if got != rec.blocks[k]:
            at = rec.offset + start + lo
            raise _corrupt(storage, manifest, read, f"fails its checksum in file bytes [{at}, "
                                                    f"{at + min(b, len(data) - lo)}) (block {k}: stored "
                                                    f"{rec.blocks[k]:08x}, read {got:08x})")


def _check_bool(storage: Storage, manifest: Manifest, read: ChunkRead, data) -> None:
    if read.entry.dtype == torch.bool and len(data) and int(data.max()) > 1:
        raise _corrupt(storage, manifest, read, "holds a bool byte other than 0 or 1")


def execute_read(storage: Storage, manifest: Manifest, read: ChunkRead, rec: ChunkRecord, verify: bool) -> None:
    path = manifest.files[read.file].path
    size = itemsize(read.entry.dtype)
    direct = _direct_destination(read)
    if direct is not None:
        out = as_bytes(direct).numpy()
        storage.read_into(path, rec.offset, memoryview(out))
        if verify:
            _check_chunk(storage, manifest, read, rec, out)
        _check_bool(storage, manifest, read, out)
        return
    lo, hi = read.lo * size, read.hi * size
    if verify:
        lo, hi = rec.block_bounds(lo, hi)
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    storage.read_into(path, rec.offset + lo, memoryview(buf.numpy()))
    if verify:
        _check_blocks(storage, manifest, read, rec, buf.numpy(), lo)
    wanted = buf[read.lo * size - lo:read.hi * size - lo]
    if (read.lo * size - lo) % size:  # a block size that is not a multiple of the item size (another writer's)
        wanted = wanted.clone()
    _check_bool(storage, manifest, read, wanted.numpy())
    src_all = from_bytes(wanted, read.entry.dtype, (read.hi - read.lo,))
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
