"""``convert``'s planner (``offline.convert_plan``) plans dim-0 tilings by arithmetic; its plan must be the one the
chunk-by-chunk planner made (every rank placed, then ``save_plan.plan_placed``): same chunks, writers, slots,
replica owners, per-rank tasks and bytes, and the same manifest chunk tables."""
from __future__ import annotations

import functools

import pytest
import torch

from shardckpt.checkpoint.save_plan import TensorPlan, plan_placed
from shardckpt.format.chunks import compact_chunks
from shardckpt.format.dtypes import dtype_name, itemsize
from shardckpt.formats.api import TensorInfo
from shardckpt.offline.convert_plan import Dim0Chunks, plan_chunks
from shardckpt.offline.streams import Output
from shardckpt.regions import FlatRange, dim0_chunk, even_flat_shard, full_region


def _output(name: str, shape: tuple, dtype: torch.dtype = torch.float32) -> Output:
    return Output(name, (name,), TensorInfo(name, dtype, shape, None), dtype)


SHAPES = {  # sizes below, at and above the world sizes tested; empty, 0-d, 1-element, ragged last chunks
    "a": (10, 3), "b": (3, 5), "c": (1,), "d": (0, 4), "e": (5, 0), "f": (), "g": (17,), "h": (64, 2, 3),
    "i": (7, 7), "j": (2,), "k": (), "l": (100,), "m": (5, 3), "n": (6, 3), "o": (6, 3),  # m, n, o: one tiling
}
FLAT = {"g", "l"}  # placed as uneven flat shards (a LOCAL output's kind): planned rank by rank
REPLICATED = {"f", "k", "i"}


def _placement(o: Output, rank: int, world: int) -> tuple:
    shape = tuple(o.source.shape)
    if o.name in REPLICATED or not shape:
        return full_region(shape), True
    if o.name in FLAT:  # irregular: rank r holds r + 1 parts of an uneven split (some ranks nothing)
        numel, parts = shape[0], world * (world + 1) // 2
        return FlatRange(min(numel, numel * (rank * (rank + 1) // 2) // parts),
                         min(numel, numel * ((rank + 1) * (rank + 2) // 2) // parts)), False
    return dim0_chunk(shape, rank, world), False


def _tiled(o: Output) -> bool:
    return bool(o.source.shape) and o.name not in FLAT | REPLICATED


def _chunk_by_chunk(outputs, place, world, files_per_rank):
    """The planner as it was (68ca8c3): every rank's placement of every tensor, then ``plan_placed``."""
    tensors, replicated = {}, set()
    for o in outputs:
        plan = tensors[o.name] = TensorPlan(dtype_name(o.dtype, o.name), tuple(o.source.shape))
        for rank in range(world):
            region, is_replica = place(o, rank)
            if is_replica:
                replicated.add(o.name)
                break
            if region.numel:
                plan.regions.append(region)
                plan.writers.append(rank)
    return plan_placed(tensors, replicated, world, "g", files_per_rank, None)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16, 64])
@pytest.mark.parametrize("files_per_rank", [1, 2])
@pytest.mark.parametrize("dtypes", ["fp32", "mixed"])
def test_the_arithmetic_plan_is_the_chunk_by_chunk_plan(world, files_per_rank, dtypes):
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    outputs = [_output(n, s, torch.float32 if dtypes == "fp32" else kinds[i % 4]) for i, (n, s) in enumerate(SHAPES.items())]
    place = functools.partial(_placement, world=world)
    want = _chunk_by_chunk(outputs, place, world, files_per_rank)
    got = plan_chunks(outputs, place, _tiled, world, files_per_rank, None, "g")
    assert list(got.tensors) == list(want.tensors)
    for name, w in want.tensors.items():
        g = got.tensors[name]
        assert (g.dtype, g.shape, list(g.regions), list(g.writers), g.slot) == \
            (w.dtype, w.shape, w.regions, w.writers, w.slot), name
        for first_file in ({r: r * files_per_rank for r in range(world)},
                           {r: (r * r + 3) * files_per_rank for r in range(world)}):  # affine, and not
            assert g.chunks(first_file) == w.chunks(first_file), name
    crcs = {name: i for i, name in enumerate(want.tensors)}
    for first_file in ({r: r * files_per_rank for r in range(world)}, {r: 3 * r + 1 for r in range(world)}):
        assert got.table(first_file, crcs) == want.table(first_file, crcs)  # (tilings shared through a memo)
    assert [got.tasks[r] for r in range(world)] == want.tasks
    assert list(got.tasks) == want.tasks
    assert got.tasks.writing_ranks() == want.writing_ranks
    size = {o.name: itemsize(o.dtype) for o in outputs}
    for r in range(world):
        assert got.tasks.bytes(r) == sum(want.tensors[t.name].regions[t.chunk].numel * size[t.name]
                                         for t in want.tasks[r])


@pytest.mark.parametrize("shape", [(10, 3), (3, 5), (1,), (1, 9), (8, 2), (9,), (1000, 7)])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 9, 1000])
def test_dim0_chunks_are_torch_chunks_non_empty(shape, world):
    chunks = Dim0Chunks(shape, world)
    want = [r for r in (dim0_chunk(shape, i, world) for i in range(world)) if r.numel]
    assert list(chunks) == want and len(chunks) == len(want)
    assert chunks[-1] == want[-1] and chunks[1:3] == want[1:3]
    assert compact_chunks(list(chunks), list(range(len(chunks))), shape) == \
        compact_chunks(want, list(range(len(want))), shape)
    with pytest.raises(IndexError):
        chunks[len(want)]
    torch_sizes = [t.numel() for t in torch.arange(max(1, torch.Size(shape).numel())).reshape(shape).chunk(world)]
    assert [r.numel for r in chunks] == [n for n in torch_sizes if n]


def test_even_flat_shards_are_planned_rank_by_rank_and_match():
    """Flat shards of a size that does not divide (trailing ranks empty), planned through ``place``."""
    world, outputs = 8, [_output("x", (13,)), _output("y", (3,))]

    def place(o, rank):
        return even_flat_shard(o.source.shape[0], rank, world), False

    want = _chunk_by_chunk(outputs, place, world, 2)
    got = plan_chunks(outputs, place, lambda o: False, world, 2, None, "g")
    assert [got.tasks[r] for r in range(world)] == want.tasks
    assert {n: (t.regions, t.writers, t.slot) for n, t in got.tensors.items()} == \
        {n: (t.regions, t.writers, t.slot) for n, t in want.tensors.items()}
