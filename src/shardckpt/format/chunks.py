"""How a tensor is tiled into stored chunks, in the manifest's two forms (FORMAT.md, ``tensors[name].chunks``).

Validation is O(1) per regular tensor: a hostile ``count`` is refused against the bytes the data files
claim before anything loops over chunks.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence, Union

from shardckpt.records import record
from shardckpt.errors import CorruptCheckpointError
from shardckpt.regions import (
    Box,
    FlatRange,
    Region,
    canonical,
    check_region,
    check_tiling,
)
from shardckpt.format.validate import (
    MAX_NUMEL,
    check_fields,
    get_field,
    get_int,
    int_field,
)


@record
class RegularChunks:
    """Compact form for the common case: chunk ``i`` is flat elements ``[i*size, min((i+1)*size, numel))``.

    Covers dim-0 chunks (``size`` = rows per chunk x row size) and even flat shards. ``files`` is either
    a tuple of file indexes (one per chunk) or ``(first, step)`` meaning chunk ``i`` is in file ``first + i*step``.
    """

    size: int
    count: int
    files: tuple[int, ...]
    affine: bool

    def __len__(self) -> int:
        return self.count

    def region(self, i: int, numel: int) -> Region:
        return FlatRange(i * self.size, min((i + 1) * self.size, numel))

    def file(self, i: int) -> int:
        return self.files[0] + i * self.files[1] if self.affine else self.files[i]

    def overlapping(self, lo: int, hi: int) -> range:
        """Chunks that may hold elements in flat bounds ``[lo, hi)``."""
        if hi <= lo or self.size == 0:
            return range(0)
        return range(lo // self.size, min((hi - 1) // self.size + 1, self.count))

    def files_used(self) -> set[int]:
        """The distinct files holding chunks; at most the number of files, however large ``count`` is."""
        if not self.count:
            return set()
        if not self.affine:
            return set(self.files)
        first, step = self.files
        return {first} if step == 0 else {first + i * step for i in range(self.count)}

    def to_json(self) -> dict:
        files = {"first": self.files[0], "step": self.files[1]} if self.affine else list(self.files)
        return {"size": self.size, "count": self.count, "files": files}


@record
class ExplicitChunks:
    """Any tiling: a list of (region, file index)."""

    regions: tuple[Region, ...]
    files: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.regions)

    def region(self, i: int, numel: int) -> Region:
        return self.regions[i]

    def file(self, i: int) -> int:
        return self.files[i]

    def overlapping(self, lo: int, hi: int) -> range:
        return range(len(self.regions))

    def files_used(self) -> set[int]:
        return set(self.files)

    def to_json(self) -> list:
        return [dict(region_to_json(r), file=f) for r, f in zip(self.regions, self.files)]


Chunks = Union[RegularChunks, ExplicitChunks]


def region_to_json(region: Region) -> dict:
    if isinstance(region, FlatRange):
        return {"flat": [region.start, region.stop]}
    return {"box": {"offsets": list(region.offsets), "sizes": list(region.sizes)}}


def compact_chunks(regions: Sequence[Region], files: Sequence[int], shape: Sequence[int]) -> Chunks:
    """The most compact description of a tiling (regions sorted by their first element)."""
    numel = math.prod(shape)
    if is_whole(regions, numel):  # a whole tensor in one chunk (most tensors of a save): what the general path returns
        return whole_chunk(numel, files[0])
    flat = [canonical(r, shape) for r in regions]
    if flat and all(isinstance(r, FlatRange) for r in flat):
        size = flat[0].numel
        if size and len(flat) == -(-numel // size) and \
                all(r.start == i * size and r.stop == min(r.start + size, numel) for i, r in enumerate(flat)):
            return regular_chunks(size, files)
    return ExplicitChunks(tuple(flat), tuple(files))


def is_whole(regions: Sequence[Region], numel: int) -> bool:
    """Whether ``regions`` is one chunk, the whole of a non-empty tensor of ``numel`` elements as a flat range (the
    common case, told with plain comparisons)."""
    return len(regions) == 1 and type(regions[0]) is FlatRange and regions[0].start == 0 and \
        regions[0].stop == numel > 0


@functools.lru_cache(maxsize=4096)
def whole_chunk(numel: int, file: int) -> RegularChunks:
    """A tensor of ``numel`` elements stored whole in one chunk in ``file`` (what ``compact_chunks`` gives it), made
    once per distinct pair (a save of many small tensors of a few shapes: 0.2 us per tensor here, not 1 us; the
    record is immutable, so it is shared)."""
    return RegularChunks(numel, 1, (file, 1), True)


def regular_chunks(size: int, files: Sequence[int]) -> RegularChunks:
    """``RegularChunks`` of ``len(files)`` chunks of ``size`` elements, chunk i in ``files[i]`` (affine if it is)."""
    step = files[1] - files[0] if len(files) > 1 else 1
    affine = all(f == files[0] + i * step for i, f in enumerate(files))
    return RegularChunks(size, len(files), (files[0], step) if affine else tuple(files), affine)


def _pair(obj: Any, where: str) -> tuple[int, int]:
    if not (isinstance(obj, list) and len(obj) == 2):
        raise CorruptCheckpointError(f"{where}: 'flat' must be [start, stop], got {str(obj)[:60]}")
    return get_int(obj[0], f"{where} flat start", 0, MAX_NUMEL), get_int(obj[1], f"{where} flat stop", 0, MAX_NUMEL)


def _region_from_json(obj: Any, shape: tuple[int, ...], strict: bool, where: str) -> Region:
    kind = "flat" if isinstance(obj, dict) and "flat" in obj else "box"
    if strict:
        check_fields(obj, (kind, "file"), (), where)
    try:
        if kind == "flat":
            region: Region = FlatRange(*_pair(obj["flat"], where))
        else:
            box = get_field(obj, "box", where)
            if strict:
                check_fields(box, ("offsets", "sizes"), (), where)
            offsets = tuple(get_int(v, f"{where} box offsets", 0, MAX_NUMEL) for v in _int_list(box, "offsets", where))
            sizes = tuple(get_int(v, f"{where} box sizes", 0, MAX_NUMEL) for v in _int_list(box, "sizes", where))
            region = Box(offsets, sizes)
        check_region(region, shape)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: invalid chunk region {str(obj)[:80]}: {e}") from None
    if region.numel == 0:
        raise CorruptCheckpointError(f"{where}: empty chunk {str(obj)[:80]} (chunks hold at least one element)")
    return canonical(region, shape)


def _int_list(obj: dict, key: str, where: str) -> list:
    value = get_field(obj, key, where)
    if not isinstance(value, list) or len(value) > 64:
        raise CorruptCheckpointError(f"{where}: {key!r} must be a list of at most 64 integers")
    return value


def _regular_from_json(obj: dict, numel: int, n_files: int, strict: bool, where: str) -> RegularChunks:
    if strict:
        check_fields(obj, ("size", "count", "files"), (), where)
    size = int_field(obj, "size", where, 1, MAX_NUMEL)
    count = int_field(obj, "count", where, 0, MAX_NUMEL)
    if count != -(-numel // size):
        raise CorruptCheckpointError(f"{where}: {count} chunks of {size} elements do not tile {numel} elements")
    files = get_field(obj, "files", where)
    if isinstance(files, dict):
        if strict:
            check_fields(files, ("first", "step"), (), where)
        first = int_field(files, "first", where, 0, n_files - 1 if count else n_files)
        step = int_field(files, "step", where, -n_files, n_files)
        if count and not 0 <= first + (count - 1) * step < n_files:
            raise CorruptCheckpointError(f"{where}: chunk file indexes run past the {n_files} files")
        return RegularChunks(size, count, (first, step), True)
    if not isinstance(files, list) or len(files) != count:
        raise CorruptCheckpointError(f"{where}: 'files' must list one file index per chunk")
    return RegularChunks(size, count, tuple(get_int(f, f"{where} chunk file", 0, n_files - 1) for f in files), False)


def chunks_from_json(obj: Any, shape: tuple[int, ...], n_files: int, strict: bool, where: str) -> Chunks:
    """Parse a tensor's ``chunks``; ``strict`` (format v2 on) also rejects unknown fields."""
    if isinstance(obj, dict):
        return _regular_from_json(obj, math.prod(shape), n_files, strict, where)
    if not isinstance(obj, list):
        raise CorruptCheckpointError(f"{where}: 'chunks' must be an object or a list")
    regions = tuple(_region_from_json(c, shape, strict, where) for c in obj)
    files = tuple(int_field(c, "file", where, 0, n_files - 1) for c in obj)
    try:
        check_tiling(regions, shape)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return ExplicitChunks(regions, files)
