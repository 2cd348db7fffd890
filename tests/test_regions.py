"""Property tests of the region math: any shape, any pair of regions, reassembly exact."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.tensor_views import view_of
from shardckpt.regions import (
    Box,
    FlatRange,
    Run,
    canonical,
    check_tiling,
    cut,
    dim0_chunk,
    even_flat_shard,
    flat_bounds,
    intersect,
    local_span,
    runs_within,
    strided_view,
)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def region_of(draw, shape):
    if draw(st.booleans()):
        n = math.prod(shape)
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        return FlatRange(a, b)
    offsets, sizes = [], []
    for dim in shape:
        o = draw(st.integers(0, dim))
        offsets.append(o)
        sizes.append(draw(st.integers(0, dim - o)))
    return Box(tuple(offsets), tuple(sizes))


def elements(region, shape):
    """Global row-major indices of a region's elements, in its local storage order."""
    ids = np.arange(math.prod(shape)).reshape(shape)
    if isinstance(region, FlatRange):
        return ids.reshape(-1)[region.start:region.stop]
    return ids[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))].reshape(-1)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_intersection_is_exact_and_views_read_the_right_elements(data):
    shape = data.draw(shapes)
    a = data.draw(region_of(shape))
    b = data.draw(region_of(shape))
    pieces = intersect(a, b, shape)
    got = np.concatenate([elements(p, shape) for p in pieces]) if pieces else np.array([], dtype=int)
    want = np.intersect1d(elements(a, shape), elements(b, shape))
    assert sorted(got.tolist()) == want.tolist(), "pieces must cover the overlap exactly once"
    for within in (a, b):
        storage = torch.from_numpy(elements(within, shape).copy())
        for piece in pieces:
            lo, hi = local_span(piece, within, shape)
            view = strided_view(piece, within, shape, base=lo)
            buf = storage[lo:hi]
            seen = view_of(buf, view).reshape(-1)
            assert seen.tolist() == elements(piece, shape).tolist()


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 5))
def test_dim0_chunks_and_flat_shards_tile_the_tensor(shape, count):
    n = math.prod(shape)
    for make in (lambda i: dim0_chunk(shape, i, count), lambda i: even_flat_shard(n, i, count)):
        covered = np.concatenate([elements(make(i), shape) for i in range(count)])
        assert covered.tolist() == list(range(n))


def test_dim0_chunk_matches_torch_chunk():
    t = torch.arange(7 * 3).reshape(7, 3)
    for i, chunk in enumerate(torch.chunk(t, 4)):
        r = dim0_chunk((7, 3), i, 4)
        assert t.reshape(-1)[r.start:r.stop].tolist() == chunk.reshape(-1).tolist()
    assert dim0_chunk((2, 5), 3, 4).numel == 0  # dim 0 smaller than the world size


def test_contiguous_box_becomes_flat():
    assert canonical(Box((1, 0), (2, 4)), (5, 4)) == FlatRange(4, 12)
    assert canonical(Box((1, 1), (2, 2)), (5, 4)) == Box((1, 1), (2, 2))


def test_invalid_regions_are_rejected():
    with pytest.raises(ValueError):
        FlatRange(3, 2)
    with pytest.raises(ValueError):
        Box((0,), (1, 2))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_contiguous_runs_list_a_regions_elements_in_order(data):
    from shardckpt.regions import contiguous_runs

    shape = data.draw(shapes)
    region = data.draw(region_of(shape))
    got = []
    local = 0
    for start, local_start, length in contiguous_runs(region, shape):
        assert local_start == local
        got.extend(range(start, start + length))
        local += length
    assert got == elements(region, shape).tolist()


@st.composite
def _region_lists(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    numel = math.prod(shape)
    regions = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            a = draw(st.integers(0, numel - 1))
            regions.append(FlatRange(a, draw(st.integers(a + 1, numel))))
        else:
            offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
            regions.append(Box(offsets, tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))))
    return shape, regions


@settings(max_examples=400, deadline=None)
@given(_region_lists())
def test_check_tiling_agrees_with_counting_every_element(case):
    """check_tiling (sort for flat ranges, a sweep for boxes) against brute force: every element once."""
    shape, regions = case
    counts = [0] * math.prod(shape)
    for r in regions:
        lo, hi = flat_bounds(r, shape)
        for i in range(lo, hi):
            if intersect(r, FlatRange(i, i + 1), shape):
                counts[i] += 1
    tiles = all(c == 1 for c in counts)
    try:
        check_tiling(regions, shape)
        verdict = True
    except ValueError:
        verdict = False
    assert verdict == tiles, (shape, regions, counts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), st.data())
def test_check_tiling_accepts_real_tilings_and_refuses_a_moved_piece(shape, data):
    """Tilings cut along one dim (dim-0 or column blocks, as ranks hold them) pass; moving a piece breaks them."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, shape[dim] - 1), max_size=3)) if shape[dim] > 1 else []))
    edges = [0] + cuts + [shape[dim]]
    boxes = [Box(tuple(a if d == dim else 0 for d in range(len(shape))),
                 tuple(b - a if d == dim else s for d, s in enumerate(shape))) for a, b in zip(edges, edges[1:])]
    check_tiling(boxes, shape)
    if len(boxes) > 1:
        moved = boxes[:-1] + [Box(boxes[0].offsets, boxes[-1].sizes)] if boxes[-1].sizes[dim] <= boxes[0].sizes[dim] \
            else [Box(boxes[-1].offsets, boxes[0].sizes)] + boxes[1:]
        with pytest.raises(ValueError):
            check_tiling(moved, shape)


# ------------------------------------------------------------------------ Run: where a run of elements lives


def mapping(runs):
    """Every element here -> (source, element there), as the runs say."""
    return {run.at + i: (run.source, run.start + i) for run in runs for i in range(run.count)}


runs_ = st.builds(Run, st.sampled_from(["a", ("f", 1), None]), st.integers(0, 50), st.integers(0, 50),
                  st.integers(0, 30))


@settings(max_examples=300, deadline=None)
@given(runs_, st.integers(0, 90), st.integers(0, 90))
def test_a_clipped_run_keeps_the_mapping_of_the_elements_it_covers(run, lo, hi):
    whole = mapping([run])
    for part, side in ((run.clip(lo, hi), "here"), (run.clip_source(lo, hi), "there")):
        want = {x: y for x, y in whole.items() if lo <= (x if side == "here" else y[1]) < hi}
        assert (mapping([part]) if part is not None else {}) == want
        assert part is None or part.count > 0
    assert run.here == FlatRange(run.at, run.at + run.count) and run.there == FlatRange(run.start, run.start + run.count)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=8), st.data())
def test_runs_within_a_tiling_cover_the_range_asked_in_order(pieces, data):
    runs, at = [], 0
    for i, (count, start) in enumerate(pieces):
        runs.append(Run(i, start, at, count))
        at += count
    lo = data.draw(st.integers(0, at))
    hi = data.draw(st.integers(lo, at))
    got = list(runs_within(runs, lo, hi))
    assert [x for r in got for x in range(r.at, r.at + r.count)] == list(range(lo, hi))
    assert mapping(got) == {x: y for x, y in mapping(runs).items() if lo <= x < hi}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(0, 20), st.data())
def test_cut_places_a_range_of_a_concatenation_in_its_parts(sizes, at, data):
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    lo = data.draw(st.integers(0, bounds[-1]))
    hi = data.draw(st.integers(lo, bounds[-1]))
    runs = cut(lo, hi, bounds, at)
    assert [x for r in runs for x in range(r.at, r.at + r.count)] == list(range(at, at + hi - lo))
    for r in runs:  # each inside its part, at the right place of the concatenation
        assert r.count > 0 and r.start + r.count <= bounds[r.source + 1] - bounds[r.source]
        assert bounds[r.source] + r.start == lo + r.at - at


def test_runs_refuse_what_cannot_be():
    with pytest.raises(ValueError):
        Run("t", -1, 0, 3)
    with pytest.raises(ValueError):
        cut(2, 9, [0, 4, 8])
