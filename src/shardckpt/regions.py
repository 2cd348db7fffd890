"""Pure region math: which elements of a tensor a shard holds, and how two shards overlap.

Every shard of a tensor is a region of that tensor's row-major element space:

- ``Box``: an N-D box (``offsets``, ``sizes``), e.g. a dim-0 chunk or a tensor-parallel block.
- ``FlatRange``: a half-open range ``[start, stop)`` of row-major element indices, e.g. a slice of a
  flattened parameter that starts and ends mid-row.

Where a run of a tensor's elements lives in another flat tensor is a ``Run``: elements ``[at, at + count)``
here are elements ``[start, start + count)`` there (a member inside a flat parameter, a rank's part of a
member, a parameter's piece of a ZeRO partition).

A region's *local storage* is its elements in global row-major order, packed densely. Resharding is
intersecting the regions a reader wants with those a writer stored and copying the overlaps; this
module plans that and never touches data (no I/O, no torch.distributed).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence, Union
from shardckpt.records import record

Shape = tuple[int, ...]


@record
class Box:
    """The elements ``offsets[d] <= i[d] < offsets[d] + sizes[d]`` for every dim ``d``."""

    offsets: Shape
    sizes: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"Box offsets {self.offsets} and sizes {self.sizes} must be >= 0")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@record
class FlatRange:
    """The row-major element indices ``start <= i < stop``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"FlatRange [{self.start}, {self.stop}) is not a valid range")

    @property
    def numel(self) -> int:
        return self.stop - self.start


Region = Union[Box, FlatRange]


@record
class Run:
    """Elements ``[at, at + count)`` of one tensor (row-major) are elements ``[start, start + count)`` of
    ``source`` (flattened). ``source`` names the other tensor as its user does: a stored tensor's name, a
    (file, tensor) or (rank, flat group) pair; a run of the tensor in its own flat storage has ``None``."""

    source: Hashable
    start: int
    at: int
    count: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.at < 0 or self.count < 0:
            raise ValueError(f"Run at={self.at} start={self.start} count={self.count} must be >= 0")

    @property
    def here(self) -> FlatRange:
        return FlatRange(self.at, self.at + self.count)

    @property
    def there(self) -> FlatRange:
        return FlatRange(self.start, self.start + self.count)

    def clip(self, lo: int, hi: int) -> Run | None:
        """The part of the run whose elements here lie in ``[lo, hi)``; None where none does."""
        a, b = max(lo, self.at), min(hi, self.at + self.count)
        return Run(self.source, self.start + a - self.at, a, b - a) if a < b else None

    def clip_source(self, lo: int, hi: int) -> Run | None:
        """The part of the run whose elements there lie in ``[lo, hi)``; None where none does."""
        a, b = max(lo, self.start), min(hi, self.start + self.count)
        return Run(self.source, a, self.at + a - self.start, b - a) if a < b else None


def runs_within(runs: Sequence[Run], lo: int, hi: int) -> Iterator[Run]:
    """The parts of ``runs`` (consecutive runs tiling a range here, in order) covering ``[lo, hi)`` here, in
    order; only the runs that overlap it are looked at (a region of a tensor in many pieces has many runs)."""
    first = max(0, bisect.bisect_right([r.at for r in runs], lo) - 1)
    for run in itertools.islice(runs, first, None):
        if run.at >= hi:
            return
        part = run.clip(lo, hi)
        if part is not None:
            yield part


def cut(lo: int, hi: int, bounds: Sequence[int], at: int = 0) -> list[Run]:
    """Elements ``[lo, hi)`` of a concatenation of parts (part ``k`` is its elements ``[bounds[k], bounds[k + 1])``)
    as runs of the parts, in order: source ``k``, ``start`` within part ``k``, ``at`` counted from ``at`` at
    ``lo``. Raises ValueError where ``[lo, hi)`` runs outside ``[bounds[0], bounds[-1])``."""
    if lo < bounds[0] or hi > bounds[-1]:
        raise ValueError(f"elements [{lo}, {hi}) run outside the parts' [{bounds[0]}, {bounds[-1]})")
    out = []
    k = bisect.bisect_right(bounds, lo) - 1
    while lo < hi:
        stop = min(hi, bounds[k + 1])
        if lo < stop:
            out.append(Run(k, lo - bounds[k], at, stop - lo))
            at, lo = at + stop - lo, stop
        k += 1
    return out


def strides(shape: Sequence[int]) -> Shape:
    """Row-major (C order) element strides of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, strides(shape)))


def unravel(flat: int, shape: Sequence[int]) -> Shape:
    out = []
    for s in strides(shape):
        out.append(flat // s if s else 0)
        flat = flat % s if s else flat
    return tuple(out)


def full_region(shape: Sequence[int]) -> FlatRange:
    return FlatRange(0, math.prod(shape))


def check_region(region: Region, shape: Sequence[int]) -> None:
    """Raise ValueError unless ``region`` lies inside a tensor of ``shape``."""
    if isinstance(region, FlatRange):
        if region.stop > math.prod(shape):
            raise ValueError(f"{region} exceeds the {math.prod(shape)} elements of shape {tuple(shape)}")
        return
    if len(region.offsets) != len(shape):
        raise ValueError(f"{region} has rank {len(region.offsets)}, tensor has shape {tuple(shape)}")
    for o, s, n in zip(region.offsets, region.sizes, shape):
        if o + s > n:
            raise ValueError(f"{region} exceeds shape {tuple(shape)}")


def flat_bounds(region: Region, shape: Sequence[int]) -> tuple[int, int]:
    """The smallest ``[lo, hi)`` of global row-major indices holding every element of ``region``."""
    if isinstance(region, FlatRange):
        return region.start, region.stop
    if region.numel == 0:
        return 0, 0
    last = tuple(o + s - 1 for o, s in zip(region.offsets, region.sizes))
    return ravel(region.offsets, shape), ravel(last, shape) + 1


def canonical(region: Region, shape: Sequence[int]) -> Region:
    """A box whose elements are consecutive in row-major order becomes a FlatRange; others stay."""
    if isinstance(region, FlatRange):
        return region
    if region.numel == 0:
        return FlatRange(0, 0)
    if shape and tuple(region.sizes[1:]) == tuple(shape[1:]):  # a dim-0 chunk, the common case: no index arithmetic
        row = math.prod(shape[1:])
        return FlatRange(region.offsets[0] * row, (region.offsets[0] + region.sizes[0]) * row)
    lo, hi = flat_bounds(region, shape)
    return FlatRange(lo, hi) if hi - lo == region.numel else region


def dim0_chunk(shape: Sequence[int], index: int, count: int) -> FlatRange:
    """Chunk ``index`` of ``count`` along dim 0, with ``torch.chunk`` semantics (ceil-sized, trailing ones empty)."""
    if not shape:
        return FlatRange(0, 1) if index == 0 else FlatRange(0, 0)
    rows = -(-shape[0] // count) if count else 0
    row_numel = math.prod(shape[1:])
    first, last = min(index * rows, shape[0]), min((index + 1) * rows, shape[0])
    if first == last:
        return FlatRange(0, 0)
    return FlatRange(first * row_numel, last * row_numel)


def even_flat_shard(numel: int, index: int, count: int) -> FlatRange:
    """Shard ``index`` of ``count`` equal flat shards of ``ceil(numel / count)`` elements, clipped to ``numel``."""
    size = -(-numel // count)
    start, stop = min(index * size, numel), min((index + 1) * size, numel)
    return FlatRange(start, stop)


def _flat_to_boxes(r: FlatRange, shape: Shape) -> Iterator[Box]:
    """Split a flat range into at most ``2 * ndim - 1`` boxes (partial rows up, a full block, partial rows down)."""
    if r.numel == 0:
        return
    if not shape:
        yield Box((), ())
        return
    st = strides(shape)
    pos, end = r.start, r.stop
    # Climb: fill out partial sub-blocks from the innermost dim outwards until aligned.
    for d in range(len(shape) - 1, -1, -1):
        block = st[d] * shape[d]
        outer_next = -(-pos // block) * block if d > 0 else end
        stop = min(outer_next, end)
        count = (stop - pos) // st[d]
        if count > 0:
            yield _row_box(pos, d, count, shape)
            pos += count * st[d]
        if pos >= end:
            return
    # Descend: what remains is aligned at its start; take whole sub-blocks from the outside in.
    for d in range(len(shape)):
        count = (end - pos) // st[d]
        if count > 0:
            yield _row_box(pos, d, count, shape)
            pos += count * st[d]
        if pos >= end:
            return


def _row_box(pos: int, d: int, count: int, shape: Shape) -> Box:
    """The box starting at flat ``pos`` spanning ``count`` steps along dim ``d`` and all of the dims after it."""
    idx = unravel(pos, shape)
    sizes = (1,) * d + (count,) + tuple(shape[d + 1:])
    return Box(idx, sizes)


def _box_intersection(a: Box, b: Box) -> Box | None:
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def intersect(a: Region, b: Region, shape: Sequence[int]) -> list[Region]:
    """The overlap of two regions of one tensor, as disjoint pieces (empty list when they do not meet).

    Contiguous boxes are handled as flat ranges, so dim-0 chunks meeting flat shards give one piece.
    """
    shape = tuple(shape)
    a, b = canonical(a, shape), canonical(b, shape)
    if isinstance(a, FlatRange) and isinstance(b, FlatRange):
        lo, hi = max(a.start, b.start), min(a.stop, b.stop)
        return [FlatRange(lo, hi)] if lo < hi else []
    if isinstance(a, Box) and isinstance(b, Box):
        box = _box_intersection(a, b)
        return [box] if box is not None else []
    box, flat = (a, b) if isinstance(a, Box) else (b, a)
    lo, hi = flat_bounds(box, shape)
    lo, hi = max(lo, flat.start), min(hi, flat.stop)
    if hi <= lo:
        return []
    pieces = (_box_intersection(part, box) for part in _flat_to_boxes(FlatRange(lo, hi), shape))
    return [p for p in pieces if p is not None]


def check_tiling(regions: Sequence[Region], shape: Sequence[int]) -> None:
    """Raise ValueError unless ``regions`` cover every element of the tensor exactly once.

    With the sizes summing to the tensor's, a tiling is a set of pairwise disjoint regions. Flat ranges
    are checked by sorting; any mix with boxes by a sweep along the dim where the boxes' offsets differ
    most, comparing only boxes whose extents along it overlap (linear for dim-0 or column tilings,
    never all pairs of a hostile list)."""
    shape = tuple(shape)
    held, total = sum(r.numel for r in regions), math.prod(shape)
    if held != total:
        raise ValueError(f"chunks hold {held} elements, the tensor has {total}")
    ordered = sorted((canonical(r, shape) for r in regions if r.numel), key=lambda r: flat_bounds(r, shape))
    if all(isinstance(r, FlatRange) for r in ordered):
        if any(a.stop > b.start for a, b in zip(ordered, ordered[1:])):
            raise ValueError("chunks overlap")
        return
    boxes = [b for r in ordered for b in ([r] if isinstance(r, Box) else _flat_to_boxes(r, shape))]
    if _boxes_overlap(boxes):
        raise ValueError("chunks overlap")


def _boxes_overlap(boxes: list[Box]) -> bool:
    if not boxes or not boxes[0].offsets:
        return len(boxes) > 1
    dim = max(range(len(boxes[0].offsets)), key=lambda d: len({b.offsets[d] for b in boxes}))
    active: list[tuple[int, int]] = []  # heap of (end along dim, index into boxes)
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[dim]):
        box = boxes[i]
        while active and active[0][0] <= box.offsets[dim]:
            heapq.heappop(active)
        if any(_box_intersection(boxes[j], box) is not None for _, j in active):
            return True
        heapq.heappush(active, (box.offsets[dim] + box.sizes[dim], i))
    return False


def local_index(flat: int, within: Region, shape: Sequence[int]) -> int:
    """Position, in ``within``'s local storage, of the global element ``flat`` (which must lie in it)."""
    if isinstance(within, FlatRange):
        return flat - within.start
    rel = tuple(i - o for i, o in zip(unravel(flat, shape), within.offsets))
    return ravel(rel, within.sizes)


def local_span(piece: Region, within: Region, shape: Sequence[int]) -> tuple[int, int]:
    """``[lo, hi)`` in ``within``'s local storage covering every element of ``piece`` (a subset of it)."""
    first, end = flat_bounds(piece, shape)
    if first == end:
        return 0, 0
    return local_index(first, within, shape), local_index(end - 1, within, shape) + 1


def contiguous_runs(region: Region, shape: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(global_start, local_start, length)`` of each maximal run of consecutive elements, in order."""
    shape = tuple(shape)
    region = canonical(region, shape)
    if isinstance(region, FlatRange):
        if region.numel:
            yield region.start, 0, region.numel
        return
    # Dims after j are covered fully, so each run spans dim j and everything inside it.
    j = len(shape) - 1
    while j > 0 and region.sizes[j] == shape[j]:
        j -= 1
    length = region.sizes[j] * math.prod(shape[j + 1:])
    outer = Box(region.offsets[:j], region.sizes[:j])
    for n, idx in enumerate(itertools.product(*(range(o, o + s) for o, s in zip(outer.offsets, outer.sizes)))):
        start = idx + (region.offsets[j],) + (0,) * (len(shape) - j - 1)
        yield ravel(start, shape), n * length, length


@dataclass(frozen=True)
class StridedView:
    """How to view ``piece`` inside a 1-D buffer of ``within``'s local storage: ``as_strided(size, stride, offset)``."""

    size: Shape
    stride: Shape
    offset: int


def strided_view(piece: Region, within: Region, shape: Sequence[int], base: int = 0) -> StridedView:
    """View parameters of ``piece``'s elements inside ``within``'s local storage, buffer starting at ``base``.

    A FlatRange piece is always contiguous in any region's local storage (consecutive global indices
    that all lie in a region stay consecutive there), so it gets a 1-D view. A Box piece gets an N-D
    view whose strides are those of ``within``'s storage.
    """
    shape = tuple(shape)
    if isinstance(piece, FlatRange):
        start = local_index(piece.start, within, shape) if piece.numel else 0
        return StridedView((piece.numel,), (1,), start - base)
    if isinstance(within, FlatRange):
        return StridedView(piece.sizes, strides(shape), ravel(piece.offsets, shape) - within.start - base)
    rel = tuple(p - w for p, w in zip(piece.offsets, within.offsets))
    return StridedView(piece.sizes, strides(within.sizes), ravel(rel, within.sizes) - base)
