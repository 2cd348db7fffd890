"""A false "unchanged" is silent wrong data (issue 39): every write that a version counter misses, the same bytes
under another dtype or shape, swapped values, a CRC32C collision. In each case step 2 must load bit for bit what was
saved, and the chunks whose bytes changed must have been written again (the save never trusts anything but the
keyed digest of the bytes it would write)."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

import shardckpt
from shardckpt.checkpoint.verify import verify
from shardckpt.format.checksum import crc32c
from tests.checkpoint.test_incremental import UNIT, assert_bits, manifest, new_bytes


@pytest.fixture(autouse=True, params=["hashed", "tracked"])
def digests_by(request, monkeypatch):
    """Every case twice: each unit hashed, and with the write tracker proving units unwritten where it can (these
    tensors are small: the tracker's floor is lowered so that it takes them)."""
    from shardckpt.checkpoint import write_tracker

    if request.param == "hashed":
        monkeypatch.setenv(write_tracker.ENV, "0")
    elif write_tracker.write_tracker() is None:
        pytest.skip("this kernel does not record page writes for us")
    else:
        monkeypatch.setattr(write_tracker, "MIN_BYTES", 4096)
    return request.param


def snapshot(sd: dict) -> dict:
    return {k: (snapshot(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in sd.items()}


def two_saves(tmp_path, sd: dict, change, **kw) -> None:
    """Save step 1, ``change(sd)`` (in place), save step 2; step 2 must load exactly the changed values."""
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT, **kw)
    change(sd)
    want = snapshot(sd)
    shardckpt.save(sd, tmp_path / "step-2", incremental=True, incremental_unit=UNIT, **kw)
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), want)
    assert verify(tmp_path / "step-2").ok


def _data_add(sd):
    sd["w"].data.add_(1)  # .data has its own version counter


def _numpy_write(sd):
    sd["w"].numpy()[5] = 123.0


def _dlpack_write(sd):
    torch.from_dlpack(sd["w"].__dlpack__()).mul_(2)


def _storage_write(sd):
    torch.tensor([], dtype=torch.float32).set_(sd["w"].untyped_storage()).fill_(7.0)


def _unsafe_preserve(sd):
    with torch.autograd._unsafe_preserve_version_counter(sd["w"]):
        sd["w"].add_(3)


def _memset(sd):
    ctypes.memset(sd["w"].data_ptr() + 8, 0xFF, 4)


def _add_zero(sd):
    sd["w"].add_(0)  # bumps the counter without a change: referenced (and still exact)


@pytest.mark.parametrize("change", [_data_add, _numpy_write, _dlpack_write, _storage_write, _unsafe_preserve, _memset,
                                    _add_zero])
def test_writes_a_version_counter_misses_are_saved(tmp_path, change, digests_by):
    sd = {"w": torch.arange(30_000, dtype=torch.float32), "frozen": torch.ones(20_000)}
    two_saves(tmp_path, sd, change)
    if change is _add_zero and digests_by == "hashed":
        assert new_bytes(tmp_path / "step-2") == 0
    elif change is _add_zero:  # the tracker saw w's pages written: written again unhashed (bytes, never values)
        assert new_bytes(tmp_path / "step-2") <= sd["w"].nbytes
    else:
        assert new_bytes(tmp_path / "step-2") >= UNIT // 2  # w's changed unit was written again


def test_the_same_bytes_under_another_dtype_and_shape(tmp_path):
    sd = {"w": torch.arange(32_768, dtype=torch.float32)}

    def reinterpret(sd):
        sd["w"] = sd["w"].view(torch.int32).reshape(128, 256)  # same bytes: referencing them is exactly right

    two_saves(tmp_path, sd, reinterpret)
    got = shardckpt.load_full(tmp_path / "step-2")["w"]
    assert got.dtype == torch.int32 and got.shape == (128, 256)


def test_the_same_bytes_under_another_item_size_compressed(tmp_path):
    """zstd-planes splits bytes by item size: a row stored for float32 is not read as bfloat16 pairs."""
    sd = {"w": (torch.arange(40_000, dtype=torch.float32) % 97 / 8)}

    def as_bf16(sd):
        sd["w"] = sd["w"].view(torch.bfloat16)

    two_saves(tmp_path, sd, as_bf16, compress="zstd")
    assert new_bytes(tmp_path / "step-2") > 0  # the planes rows were written again


def test_two_tensors_swapped(tmp_path):
    sd = {"a": torch.zeros(20_000), "b": torch.ones(20_000)}

    def swap(sd):
        sd["a"], sd["b"] = sd["b"], sd["a"]

    two_saves(tmp_path, sd, swap)
    assert new_bytes(tmp_path / "step-2") >= 2 * 20_000 * 4


def _crc_collision(data: bytes) -> bytes:
    """Another byte string of the same length and CRC32C: 4 bytes at the end fixed by CRC linearity."""
    changed = bytearray(data)
    changed[0] ^= 0x5A
    target = crc32c(data)
    # crc(x ^ d) = crc(x) ^ crc(d) ^ crc(0): solve for the last 4 bytes by brute linear search over 32 unit vectors
    base = bytearray(changed)
    zero = crc32c(bytes(len(data)))
    basis = []
    for bit in range(32):
        d = bytearray(len(data))
        d[-4 + bit // 8] = 1 << (bit % 8)
        basis.append((crc32c(bytes(d)) ^ zero, bit))
    need = crc32c(bytes(base)) ^ target
    rows = [(v, 1 << b) for v, b in basis]
    solution = 0
    for bit in range(32):  # gaussian elimination over GF(2)
        pivot = next((i for i, (v, _) in enumerate(rows) if v >> bit & 1), None)
        if pivot is None:
            continue
        pv, pm = rows.pop(pivot)
        rows = [(v ^ pv, m ^ pm) if v >> bit & 1 else (v, m) for v, m in rows]
        if need >> bit & 1:
            need ^= pv
            solution ^= pm
    assert need == 0
    for bit in range(32):
        if solution >> bit & 1:
            base[-4 + bit // 8] ^= 1 << (bit % 8)
    assert crc32c(bytes(base)) == target and bytes(base) != data
    return bytes(base)


def test_a_crc32c_collision_is_not_taken_for_unchanged(tmp_path):
    data = bytes(range(256)) * 16
    other = _crc_collision(data)
    sd = {"m": torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()}

    def collide(sd):
        sd["m"].copy_(torch.frombuffer(bytearray(other), dtype=torch.uint8))

    two_saves(tmp_path, sd, collide)
    assert new_bytes(tmp_path / "step-2") >= len(data)


def test_a_new_tensor_in_the_old_ones_place(tmp_path):
    sd = {"w": torch.zeros(10_000)}

    def replace(sd):
        new = torch.zeros(10_000)
        new[17] = 1
        sd["w"] = new

    two_saves(tmp_path, sd, replace)


def test_a_complement_pair_of_a_small_mask(tmp_path):
    """xxh3's collision shape (a word and its complement): irrelevant to keyed BLAKE3, checked anyway."""
    sd = {"mask": torch.tensor(np.arange(64) % 2 == 0)}

    def flip(sd):
        sd["mask"].copy_(~sd["mask"])

    two_saves(tmp_path, sd, flip)
    assert manifest(tmp_path / "step-2").tensors["mask"].crc32c != manifest(tmp_path / "step-1").tensors["mask"].crc32c


def test_nothing_in_the_save_path_reads_version_counters():
    """The reuse decision rests on bytes only: no module of the incremental save looks at ``_version``."""
    import shardckpt.checkpoint.incremental as inc
    import shardckpt.checkpoint.units as units

    for module in (inc, units):
        assert "._version" not in open(module.__file__).read().replace("shardckpt._version", "")


def _reshard_reference(root: str, step: int) -> None:
    import torch.distributed as dist

    from shardckpt import ShardedTensor
    from shardckpt.regions import FlatRange

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(24_000, dtype=torch.float32)
    full[step * 1000] = -step  # a different element each step, in a different shard at each world size
    lo, hi = rank * len(full) // world, (rank + 1) * len(full) // world
    shardckpt.save({"w": ShardedTensor(full[lo:hi].clone(), (len(full),), FlatRange(lo, hi))},
                   os.path.join(root, f"step-{step}"), incremental=True, incremental_unit=8 << 10)


def test_reshard_between_saves_loads_exactly(tmp_path):
    from tests._dist import run_ranks

    for step, world in ((1, 2), (2, 3), (3, 2), (4, 1)):
        run_ranks(world, _reshard_reference, str(tmp_path), step) if world > 1 else \
            _reshard_single(str(tmp_path), step)
    for step in (1, 2, 3, 4):
        want = torch.arange(24_000, dtype=torch.float32)
        want[step * 1000] = -step
        assert torch.equal(shardckpt.load_full(tmp_path / f"step-{step}")["w"], want)


def _reshard_single(root: str, step: int) -> None:
    full = torch.arange(24_000, dtype=torch.float32)
    full[step * 1000] = -step
    shardckpt.save({"w": full}, os.path.join(root, f"step-{step}"), incremental=True, incremental_unit=8 << 10)
