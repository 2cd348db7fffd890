"""The whole-tensor checksum of every tensor a read covers whole (FORMAT.md, "Reading a tensor", step 4).

Every chunk read whole was checked block by block, so its checksum is its block CRCs combined; the tensor's is
its chunks' combined in turn (FORMAT.md, "Checking a tensor checksum from chunks"): arithmetic on a few CRCs
per chunk, no second pass over the bytes. It catches a manifest whose tensor table disagrees with the data
(resealed, or written by a faulty writer), which each chunk's own checksum cannot.
"""
from __future__ import annotations

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.checksum import combine_equal_pieces, tensor_crc_term
from shardckpt.format.chunks import RegularChunks
from shardckpt.format.dtypes import itemsize
from shardckpt.format.index import ChunkRecord
from shardckpt.format.manifest import TensorEntry
from shardckpt.formats.native.plan import ChunkRead
from shardckpt.regions import contiguous_runs


def _tensor_crc(reads: list[tuple[ChunkRead, ChunkRecord]]) -> int | None:
    """The tensor's checksum from its chunks, all read whole; None where a chunk is several runs of the tensor
    (a box split across an inner dim): its runs' CRCs were never computed."""
    entry = reads[0][0].entry
    size, total = itemsize(entry.dtype), entry.nbytes
    reads = sorted(reads, key=lambda pair: pair[0].chunk)
    crcs = [combine_equal_pieces(rec.blocks, rec.block_size, rec.length) for _, rec in reads]
    if isinstance(entry.chunks, RegularChunks):  # consecutive flat ranges of one size: combined as blocks are
        return combine_equal_pieces(crcs, entry.chunks.size * size, total)
    term = 0
    for (read, _), crc in zip(reads, crcs):
        runs = list(contiguous_runs(read.region, entry.shape))
        if len(runs) != 1:
            return None
        start, _, n = runs[0]
        term ^= tensor_crc_term(crc, total - (start + n) * size)
    return term


def check_whole_tensors(reads: list[ChunkRead], records: list[ChunkRecord], where: str) -> None:
    """Raise ``CorruptCheckpointError`` for a tensor whose chunks were all read whole (and verified), or whose one
    chunk of one block was read (checked whole, even for part of it), but whose checksum is not the manifest's."""
    by_tensor: dict[str, list[tuple[ChunkRead, ChunkRecord]]] = {}
    for read, rec in zip(reads, records):
        entry = read.entry
        if len(entry.chunks) == 1:  # the tensor is this one chunk (every small tensor): its checksum is the chunk's
            blocks = rec.blocks
            # A chunk of one block was read and checked whole even for part of it (reads widen to whole blocks): its
            # CRC is the tensor's then too, which catches a resealed index's rows swapped between two tensors.
            if len(blocks) == 1 or (read.lo == 0 and read.hi == read.region.numel):
                crc = blocks[0] if len(blocks) == 1 else combine_equal_pieces(blocks, rec.block_size, rec.length)
                if crc != entry.crc32c:
                    _check_crc(entry, crc, where)
        else:
            by_tensor.setdefault(entry.name, []).append((read, rec))
    for pairs in by_tensor.values():
        entry = pairs[0][0].entry
        if len(pairs) != len(entry.chunks) or any(r.lo != 0 or r.hi != r.region.numel for r, _ in pairs):
            continue  # part of the tensor: only its blocks' checksums apply
        crc = _tensor_crc(pairs)
        if crc is not None:
            _check_crc(entry, crc, where)


def _check_crc(entry: TensorEntry, crc: int, where: str) -> None:
    if crc != entry.crc32c:
        raise CorruptCheckpointError(f"{where}: tensor {entry.name!r}: its chunks combine to checksum {crc:08x}, the "
                                     f"manifest records {entry.crc32c:08x} for the whole tensor: the manifest "
                                     "and the data disagree; run `shardckpt verify`")
