"""Planning reads of shardckpt's format (pure): which bytes of which stored chunk each request needs."""
from __future__ import annotations

from dataclasses import dataclass, field

from shardckpt.format.chunks import RegularChunks
from shardckpt.format.manifest import TensorEntry
from shardckpt.formats.requests import CheckedRequest
from shardckpt.regions import FlatRange, Region, flat_bounds, intersect, local_span


@dataclass
class ChunkRead:
    """Elements ``[lo, hi)`` of one stored chunk, and the pieces of targets they fill."""

    entry: TensorEntry
    chunk: int
    file: int
    region: Region
    lo: int
    hi: int
    copies: list[tuple[Region, CheckedRequest]] = field(default_factory=list)


def plan_reads(targets: list[CheckedRequest]) -> list[ChunkRead]:
    """For each stored chunk some target (a request checked against the manifest's entries: ``info`` is the
    ``TensorEntry``) overlaps: the element span to read and the pieces to copy."""
    reads: dict[tuple[str, int], ChunkRead] = {}
    for target in targets:
        if isinstance(target.region, FlatRange) and isinstance(target.info.chunks, RegularChunks):
            _plan_flat_regular(target, reads)
        else:
            _plan_general(target, reads)
    return list(reads.values())


def _read_for(reads: dict, entry: TensorEntry, i: int, region: Region) -> ChunkRead:
    read = reads.get((entry.name, i))
    if read is None:
        read = reads[(entry.name, i)] = ChunkRead(entry, i, entry.chunks.file(i), region, region.numel, 0)
    return read


def _plan_flat_regular(target: CheckedRequest, reads: dict) -> None:
    """A flat range against regular flat chunks (the FSDP case at scale): integer arithmetic only."""
    entry, region = target.info, target.region
    lo, hi, chunks = region.start, region.stop, entry.chunks
    size, numel = chunks.size, entry.numel
    if chunks.count == 1 and lo < hi and (entry.name, 0) not in reads:  # a tensor stored whole (most small ones)
        whole = region if lo == 0 and hi == numel else FlatRange(0, numel)
        reads[(entry.name, 0)] = ChunkRead(entry, 0, chunks.file(0), whole, lo, hi, [(region, target)])
        return
    for i in chunks.overlapping(lo, hi):
        start, stop = i * size, min((i + 1) * size, numel)
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        read = reads.get((entry.name, i))
        if read is None:
            read = reads[(entry.name, i)] = ChunkRead(entry, i, entry.chunks.file(i), FlatRange(start, stop),
                                                      a - start, b - start)
        else:
            read.lo, read.hi = min(read.lo, a - start), max(read.hi, b - start)
        read.copies.append((target.region if (a, b) == (lo, hi) else FlatRange(a, b), target))


def _plan_general(target: CheckedRequest, reads: dict) -> None:
    entry = target.info
    lo, hi = flat_bounds(target.region, entry.shape)
    for i in entry.chunks.overlapping(lo, hi):
        region = entry.chunks.region(i, entry.numel)
        pieces = intersect(region, target.region, entry.shape)
        if not pieces:
            continue
        read = _read_for(reads, entry, i, region)
        for piece in pieces:
            a, b = local_span(piece, region, entry.shape)
            read.lo, read.hi = min(read.lo, a), max(read.hi, b)
            read.copies.append((piece, target))
