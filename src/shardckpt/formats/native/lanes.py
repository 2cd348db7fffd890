"""Planning the parallel read of a file read (nearly) whole from an object store (pure).

One streaming GET per file is one connection: against a real server (radosgw, S3) the raw client's 8
ranged GETs at once are faster. So a streamed file's reads are cut into *lanes*, consecutive stretches of
the file of about equal size, each read through a streaming GET of its own, in file order. A read larger
than ``PIECE_BYTES`` is first cut into pieces at checksum-block boundaries, so that one big chunk spreads
over several lanes, every piece is checked on its own whole blocks, and a piece read through a buffer
(a cast, a scattered target) needs at most ``PIECE_BYTES`` of it. Few lanes of many chunks each, rather
than one GET per part: where a ranged GET costs the whole object (moto) only the lane count is paid.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardckpt.format.dtypes import itemsize
from shardckpt.format.index import ChunkRecord
from shardckpt.formats.native.plan import ChunkRead
from shardckpt.regions import FlatRange, intersect

PIECE_BYTES = 16 << 20  # the most bytes one piece of a cut read spans
LANE_BYTES = 16 << 20  # a file gets no more lanes than it has this many bytes to read


@dataclass
class Piece:
    """A read to execute (a whole planned read, or part of one) and the file bytes ``[start, stop)`` it touches."""

    read: ChunkRead
    rec: ChunkRecord
    start: int
    stop: int


def stored_span(read: ChunkRead, rec: ChunkRecord) -> tuple[int, int]:
    """The file bytes a read of ``read`` touches at most: its elements widened to whole blocks (frames)."""
    size = itemsize(read.entry.dtype)
    lo, hi = rec.block_bounds(read.lo * size, read.hi * size)
    if rec.frames:
        b = rec.block_size
        lo, hi = rec.frame_starts[lo // b], rec.frame_starts[-(-hi // b)]
    return rec.offset + lo, rec.offset + hi


def cut_read(read: ChunkRead, rec: ChunkRecord, piece_bytes: int | None = None) -> list[ChunkRead]:
    """``read`` as consecutive reads of at most about ``piece_bytes`` (``PIECE_BYTES``), cut at block boundaries,
    each with the copies its elements fill; ``[read]`` where it is small or cannot be cut (a chunk that is not
    one flat range of its tensor, or blocks that split its elements)."""
    size, b, piece_bytes = itemsize(read.entry.dtype), rec.block_size, piece_bytes or PIECE_BYTES
    if (read.hi - read.lo) * size <= piece_bytes or not isinstance(read.region, FlatRange) or b % size:
        return [read]
    step = max(1, piece_bytes // b) * b // size  # elements per piece, whole blocks
    bounds = [read.lo, *range((read.lo // step + 1) * step, read.hi, step), read.hi]
    first, shape = read.region.start, read.entry.shape
    pieces = []
    for a, z in zip(bounds, bounds[1:]):
        span = FlatRange(first + a, first + z)
        copies = [(sub, target) for piece, target in read.copies for sub in intersect(piece, span, shape)]
        if copies:
            pieces.append(ChunkRead(read.entry, read.chunk, read.file, read.region, a, z, copies))
    return pieces


def lanes(pieces: list[Piece], count: int) -> list[list[Piece]]:
    """``pieces`` (of one file, in file order) as at most ``count`` runs of consecutive pieces with about equal
    bytes each, and no more runs than ``LANE_BYTES`` go into their bytes."""
    total = sum(p.stop - p.start for p in pieces)
    count = max(1, min(count, total // LANE_BYTES, len(pieces)))
    runs: list[list[Piece]] = [[]]
    done = 0
    for p in pieces:
        if runs[-1] and done + (p.stop - p.start) / 2 > total * len(runs) / count:  # the cut nearest the share
            runs.append([])
        runs[-1].append(p)
        done += p.stop - p.start
    return runs


def share(sizes: dict[int, int], count: int) -> dict[int, int]:
    """``count`` lanes shared among files by the bytes read from each (``sizes``), at least one each."""
    total = sum(sizes.values()) or 1
    return {f: max(1, round(count * n / total)) for f, n in sizes.items()}
