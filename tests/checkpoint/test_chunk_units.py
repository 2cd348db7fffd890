"""Global-aligned units (format/chunk_identity.py ``unit_bounds``): an incremental save cuts each rank's shard at
the tensor's own multiples of the unit, so that a reshard between two saves changes only the units that straddle a
shard boundary; every other unit is the same region with the same bytes, and is referenced, not written."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.format.chunk_identity import unit_bounds, unit_length


def _shards(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    return list(zip(points, points[1:]))


def _units(n: int, unit: int, cuts: list[int]) -> list[tuple[int, int]]:
    return [u for a, b in _shards(n, cuts) for u in unit_bounds(a, b, unit)]


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 700))
def test_units_tile_the_range_and_cut_only_at_multiples(start, length, unit):
    stop = start + length
    units = unit_bounds(start, stop, unit)
    assert [a for a, _ in units] + [stop] == [start] + [b for _, b in units] or (not units and start == stop)
    assert all(0 < b - a <= unit for a, b in units)
    assert all(a % unit == 0 for a, _ in units[1:])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 500), st.lists(st.integers(0, 4000), max_size=6),
       st.lists(st.integers(0, 4000), max_size=6))
def test_a_reshard_changes_only_the_units_a_shard_boundary_cuts(n, unit, old_cuts, new_cuts):
    old, new = set(_units(n, unit, old_cuts)), set(_units(n, unit, new_cuts))
    new_bounds = {p for shard in _shards(n, new_cuts) for p in shard}
    for a, b in old:
        cut_inside = any(a < p < b for p in new_bounds)
        ends_on_new_cuts = all(p % unit == 0 or p in new_bounds for p in (a, b))
        assert ((a, b) in new) == (not cut_inside and ends_on_new_cuts), (a, b)
    # so at most two units per shard boundary of either side differ
    assert len(old ^ new) <= 2 * (len(set(old_cuts) | set(new_cuts)) + 1) * 2


def test_unit_length_is_whole_rows_of_at_most_the_budget():
    assert unit_length(4, 16 << 20) == 4 << 20
    assert unit_length(2, 16 << 20, row_elements=4096) == 2048
    assert unit_length(4, 100, row_elements=1000) == 1  # a row larger than the budget: one row per unit
    with pytest.raises(ValueError):
        unit_length(0, 10)
    with pytest.raises(ValueError):
        unit_bounds(5, 4, 1)
