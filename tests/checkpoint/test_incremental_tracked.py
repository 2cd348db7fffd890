"""Incremental saves with the write tracker (docs/design/incremental.md, 5.3): a unit whose pages the kernel saw
unwritten is referenced without being read, by ``save`` and in ``async_save``'s window; a unit written in any way
is read, hashed and, if changed, written; what loads is always exactly what was saved."""
from __future__ import annotations

import ctypes

import pytest
import torch

import shardckpt
import shardckpt.checkpoint.incremental as inc
import shardckpt.checkpoint.window_hash as window_hash
from shardckpt.checkpoint import write_tracker
from shardckpt.checkpoint.page_writes import PAGE
from tests.checkpoint.test_incremental import assert_bits, manifest, new_bytes

UNIT = 256 << 10
BASE = (4 << 20) // 4  # 4 MiB of float32: 16 units


@pytest.fixture(autouse=True)
def needs_tracker():
    if write_tracker.write_tracker() is None:
        pytest.skip("this kernel does not record page writes for us (userfaultfd async write-protect, Linux 6.7+)")


@pytest.fixture
def hash_calls(monkeypatch):
    """Sizes of the units hashed by a save (``incremental``) and in async_save's window (``window_hash``, whose
    sizes are negative here)."""
    calls = []
    for module, sign in ((inc, 1), (window_hash, -1)):
        real = module.chunk_hash
        monkeypatch.setattr(module, "chunk_hash", lambda key, data, real=real, sign=sign:
                            calls.append(sign * len(data)) or real(key, data))
    return calls


def page_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory whose first and last pages hold nothing else: in the heap, the allocator's own
    writes beside a tensor dirty its edge pages (then its edge units are read again, rightly; the tests count)."""
    big = torch.empty(t.numel() + 2 * PAGE // t.element_size(), dtype=t.dtype)
    at = (-big.data_ptr() % PAGE) // t.element_size()
    out = big[at:at + t.numel()]
    out.copy_(t)
    return out


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"base": page_aligned(torch.randn(BASE, generator=g)), "adapter": torch.randn(1000, generator=g)}


def snapshot(sd):
    return {k: v.clone() for k, v in sd.items()}


# Each write lands mid-unit: the tracker sees pages, and a page across a unit boundary dirties both units.
def _memset(sd):
    ctypes.memset(sd["base"].data_ptr() + 5 * UNIT + UNIT // 2, 0x3C, 2)


def _numpy(sd):
    sd["base"].numpy()[(9 * UNIT + UNIT // 3) // 4] = 1.5


def _data(sd):
    sd["base"].data[(3 * UNIT + UNIT // 2) // 4 + 7].add_(1)


@pytest.mark.parametrize("write", [_memset, _numpy, _data])
def test_save_reads_only_the_units_written(tmp_path, hash_calls, write):
    sd = state()
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT)
    hash_calls.clear()
    sd["adapter"].add_(1)
    shardckpt.save(sd, tmp_path / "step-2", incremental=True, incremental_unit=UNIT)
    assert sorted(hash_calls) == [4000]  # the adapter only: the base was not read
    assert new_bytes(tmp_path / "step-2") == 4000
    write(sd)
    want = snapshot(sd)
    hash_calls.clear()
    shardckpt.save(sd, tmp_path / "step-3", incremental=True, incremental_unit=UNIT)
    assert sorted(hash_calls) == [4000]  # the adapter; the unit written is written again unhashed (the writer's
    assert new_bytes(tmp_path / "step-3") == UNIT  # digest is its row's), and nothing else of the base is read
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), want)


@pytest.mark.parametrize("write", [_memset, _numpy, _data])
def test_async_window_reads_only_the_units_written(tmp_path, hash_calls, write):
    sd = state()
    saver = shardckpt.AsyncSaver()
    try:
        for step in (1, 2):
            saver.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT).wait()
        write(sd)
        want = snapshot(sd)
        hash_calls.clear()
        saver.save(sd, tmp_path / "step-3", incremental=True, incremental_unit=UNIT).wait()
        # the window read only the written unit (it differs: the base is copied), the background hashed the copy
        assert hash_calls.count(-UNIT) == 1 and hash_calls.count(UNIT) == BASE * 4 // UNIT
        assert_bits(shardckpt.load_full(tmp_path / "step-3"), want)
        hash_calls.clear()
        saver.save(sd, tmp_path / "step-4", incremental=True, incremental_unit=UNIT).wait()
        assert UNIT not in hash_calls and -UNIT not in hash_calls  # nothing written since step 3: the base is not read
        assert new_bytes(tmp_path / "step-4") == 0
        assert_bits(shardckpt.load_full(tmp_path / "step-4"), want)
    finally:
        saver.close()


def test_tracked_and_hashed_saves_record_the_same_digests(tmp_path, monkeypatch):
    rows = {}
    for mode in ("tracked", "hashed"):
        if mode == "hashed":
            monkeypatch.setenv(write_tracker.ENV, "0")
        sd = state()
        for step in (1, 2, 3):
            if step == 3:
                _memset(sd)
            shardckpt.save(sd, tmp_path / mode / f"step-{step}", incremental=True, incremental_unit=UNIT)
        rows[mode] = {name: t.crc32c for name, t in manifest(tmp_path / mode / "step-3").tensors.items()}
        assert_bits(shardckpt.load_full(tmp_path / mode / "step-3"), sd)
    assert rows["tracked"] == rows["hashed"]


def test_a_replaced_tensor_at_the_same_place_is_read(tmp_path, hash_calls):
    """The base's storage freed and a new one made: same name, shape, maybe the same address; never trusted."""
    sd = state()
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT)
    sd["base"] = page_aligned(torch.zeros(BASE))
    hash_calls.clear()
    shardckpt.save(sd, tmp_path / "step-2", incremental=True, incremental_unit=UNIT)
    assert hash_calls.count(UNIT) == BASE * 4 // UNIT
    assert_bits(shardckpt.load_full(tmp_path / "step-2")["base"], torch.zeros(BASE))


@pytest.mark.parametrize("saver", ["save", "async"])
def test_a_tensor_sharing_its_edge_pages_is_proven_and_its_edge_writes_are_saved(tmp_path, hash_calls, saver):
    """A heap-like tensor (its first and last pages shared with other bytes, which others write): not read while
    unchanged, and a write to its bytes on a shared page is saved."""
    import mmap

    m = mmap.mmap(-1, BASE * 4 + 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(memoryview(m)[100:100 + BASE * 4], dtype=torch.float32)
    base.copy_(torch.randn(BASE))
    sd = {"base": base}
    async_saver = shardckpt.AsyncSaver() if saver == "async" else None

    def save(step):
        if async_saver is None:
            shardckpt.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT)
        else:
            async_saver.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT).wait()

    try:
        save(1)
        save(2)
        m[0:64] = b"\x05" * 64  # the neighbour's bytes on base's first page
        hash_calls.clear()
        save(3)
        assert hash_calls == [] and new_bytes(tmp_path / "step-3") == 0
        base[-1] = 123.0  # base's own bytes on its shared last page
        want = base.clone()
        save(4)
        assert new_bytes(tmp_path / "step-4") == UNIT
        assert_bits(shardckpt.load_full(tmp_path / "step-4")["base"], want)
    finally:
        if async_saver is not None:
            async_saver.close()
        del sd, base
