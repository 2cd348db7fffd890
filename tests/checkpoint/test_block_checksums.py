"""Every byte a load returns is checksummed, partial reads included (issue 21).

A resharding load reads part of most chunks. From format v2 each chunk carries one CRC32C per block;
a partial read widens to whole blocks around the wanted bytes and checks each of them.
"""
from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt import Box, CorruptCheckpointError, FlatRange, ShardedTensor
from shardckpt.checkpoint.load import load_pieces
from shardckpt.formats.api import ReadRequest
from shardckpt.checkpoint.verify import verify
from shardckpt.regions import flat_bounds, intersect
from shardckpt.tensor_views import as_bytes
from tests._helpers import flip_byte
from tests._dist import run_ranks
from tests.checkpoint.cases import block_size, shard
from tests.state_dict._train import load_state_refused, save_local_state
from tests.storage._util import index_rows

ROWS, COLS = 2048, 512  # 4 MiB of float32: four 1 MiB blocks


def _flip(path: str, name: str, byte_in_chunk: int, chunk: int = 0) -> int:
    """Flip one stored byte of a chunk of tensor ``name``; returns the chunk's offset in the data file."""
    for index in glob.glob(os.path.join(path, "data-*", "*.index.json")):
        for row in index_rows(open(index, "rb").read()):
            if row[0] == name and row[1] == chunk:
                data_file = index[:-len(".index.json")] + ".bin"
                flip_byte(data_file, row[2] + byte_in_chunk, 0x20)
                return row[2]
    raise AssertionError(f"{name} not found")


def _rows(full: torch.Tensor, lo: int, hi: int) -> ShardedTensor:
    return ShardedTensor(torch.zeros(hi - lo, full.shape[1]), tuple(full.shape), Box((lo, 0), (hi - lo, full.shape[1])))


def test_partial_load_over_a_flipped_byte_raises(tmp_path):
    """The issue's repro: rows 1024:1536 of a 4 MiB tensor, one flipped byte inside them."""
    path = str(tmp_path / "ckpt")
    full = torch.randn(ROWS, COLS)
    shardckpt.save({"w": full}, path)
    flipped = 1200 * COLS * 4 + 17  # in row 1200, block 2
    chunk_at = _flip(path, "w", flipped)
    with pytest.raises(CorruptCheckpointError, match=r"'w' chunk 0 fails its checksum in file bytes \[\d+, \d+\)"):
        shardckpt.load({"w": _rows(full, 1024, 1536)}, path)
    # A flat range starting mid-row, as a FSDP flat shard would ask: also refused.
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        load_pieces(path, lambda m: [ReadRequest("w", FlatRange(1199 * COLS + 7, 1201 * COLS + 3),
                                                  torch.empty(2 * COLS - 4))])
    # Rows in other blocks load exactly.
    for lo, hi in ((0, 512), (1536, 2048)):
        sd = {"w": _rows(full, lo, hi)}
        shardckpt.load(sd, path)
        assert torch.equal(sd["w"].local, full[lo:hi])
    # verify names the damaged block by its byte range in the file.
    mib = 1 << 20
    block = flipped // mib
    (problem,) = verify(path).problems[:1]
    assert f"file bytes [{chunk_at + block * mib}, {chunk_at + (block + 1) * mib}) (block {block}" in problem.message


DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float64)


@st.composite
def _cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    numel = torch.Size(shape).numel()
    dtype = draw(st.sampled_from(DTYPES))
    block = draw(st.sampled_from((1, 7, 16, 64, 1 << 20)))
    flip = draw(st.integers(0, numel * torch.empty(0, dtype=dtype).element_size() - 1))
    if draw(st.booleans()):
        a = draw(st.integers(0, numel - 1))
        region = FlatRange(a, draw(st.integers(a + 1, numel)))
    else:
        offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
        sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
        region = Box(offsets, sizes)
    return shape, dtype, block, flip, region


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_partial_loads_return_exact_data_or_raise(case):
    """Random shapes, block sizes, corrupted bytes and load regions: exact data, or an error exactly when
    the damaged block lies in the blocks the read covers; an overlapping region always raises."""
    shape, dtype, block, flip, region = case
    full = (torch.arange(torch.Size(shape).numel(), dtype=torch.float64) * 1.37 - 5).to(dtype).reshape(shape)
    size = full.element_size()
    with tempfile.TemporaryDirectory() as tmp, block_size(block):
        path = os.path.join(tmp, "ckpt")
        shardckpt.save({"t": full}, path)
        _flip(path, "t", flip)
        local = torch.zeros(region.numel, dtype=dtype)
        sd = {"t": ShardedTensor(local if isinstance(region, FlatRange) else local.reshape(region.sizes),
                                 shape, region)}
        lo, hi = flat_bounds(region, shape)
        widened = (lo * size // block * block, min(-(-hi * size // block) * block, full.numel() * size))
        must_raise = widened[0] <= flip // block * block < widened[1]
        holds_flip = bool(intersect(region, FlatRange(flip // size, flip // size + 1), shape))
        assert must_raise or not holds_flip
        if must_raise:
            with pytest.raises(CorruptCheckpointError, match="'t'"):
                shardckpt.load(sd, path)
        else:
            shardckpt.load(sd, path)
            want = full.reshape(-1)[lo:hi] if isinstance(region, FlatRange) else \
                full[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))]
            assert torch.equal(as_bytes(sd["t"].local.contiguous()), as_bytes(want.contiguous()))


def _save_sharded(path: str, kind: str) -> None:
    full = torch.arange(768 * 1024, dtype=torch.float32).reshape(768, 1024)  # 3 MiB
    shardckpt.save({"w": shard(full, kind, dist.get_rank(), dist.get_world_size())}, path)


def _load_expect_corrupt(path: str, kind: str) -> str:
    full = torch.zeros(768, 1024)
    target = shard(full, kind, dist.get_rank(), dist.get_world_size())
    with pytest.raises(CorruptCheckpointError, match="'w'") as info:
        shardckpt.load({"w": target}, path)
    return str(info.value)


@pytest.mark.parametrize("save_kind,load_kind", [("dim0", "flat"), ("flat", "cols"), ("cols", "dim0")])
def test_resharding_loads_detect_a_flip_at_every_world_size(tmp_path, save_kind, load_kind):
    """Saved at ws 2, loaded at ws 1, 3 and 4 in another sharding: every rank raises (one rank's read
    covers the flipped byte, and the failure reaches all ranks)."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_sharded, path, save_kind)
    _flip(path, "w", 300_000)
    for load_ws in (1, 3, 4):
        messages = run_ranks(load_ws, _load_expect_corrupt, path, load_kind)
        assert all("checksum" in m for m in messages)


def test_load_state_at_a_new_world_size_detects_a_flip(tmp_path):
    """load_state reads slices of saved flat shards (partial reads): a flipped byte in any of them is caught."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, save_local_state, path)
    index = sorted(glob.glob(os.path.join(path, "data-*", "*.index.json")))[0]
    name, chunk, _, length, *_ = max(index_rows(open(index, "rb").read()), key=lambda r: r[3])
    _flip(path, name, length // 2, chunk)
    run_ranks(3, load_state_refused, path, CorruptCheckpointError, "checksum")
