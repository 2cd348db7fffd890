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
    canonical,
    dim0_chunk,
    even_flat_shard,
    intersect,
    local_span,
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
