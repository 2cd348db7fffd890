"""Incremental saves with the write tracker (docs/design/incremental.md, 5.3): a unit whose pages the kernel saw
unwritten is referenced without being read, by ``save`` and in ``async_save``'s window; a unit written in any way
is read, hashed and, if changed, written; what loads is always exactly what was saved."""
from __future__ import annotations

import ctypes
import shutil

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


def test_a_forked_childs_save_does_not_trust_the_parents_marks(tmp_path):
    """Saving a fork's copy-on-write snapshot while the parent trains: the child's tracker is its own."""
    import os

    sd = state()
    for step in (1, 2):
        shardckpt.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT)
    sd["base"].numpy()[:] = 42.0  # no version bump
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports by exit status
        code = 1
        try:
            shardckpt.save(sd, tmp_path / "step-3", incremental=True, incremental_unit=UNIT)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), sd)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _io_uring() -> int:
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    ring = ctypes.CDLL(None, use_errno=True).syscall(425, 4, params)  # io_uring_setup (x86_64 and aarch64)
    if ring < 0:
        pytest.skip("io_uring is not available here")
    return ring


def test_tracking_pauses_while_a_tensor_is_registered_with_an_io_uring(tmp_path, hash_calls):
    """io_uring fixed buffers (and RDMA, VFIO registrations) are written by the kernel or a device through pinned
    pages, without a fault: while the process has any, every unit is hashed."""
    import os

    sd = state()
    for step in (1, 2):
        shardckpt.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT)
    ring = _io_uring()
    try:
        hash_calls.clear()
        shardckpt.save(sd, tmp_path / "step-3", incremental=True, incremental_unit=UNIT)
        assert UNIT not in hash_calls  # a ring without buffers (libuv's, in torch's TCPStore) changes nothing
        iov = _Iovec(sd["base"].data_ptr(), sd["base"].nbytes)
        assert ctypes.CDLL(None).syscall(427, ring, 0, ctypes.byref(iov), 1) == 0  # IORING_REGISTER_BUFFERS
        hash_calls.clear()
        shardckpt.save(sd, tmp_path / "step-4", incremental=True, incremental_unit=UNIT)
        assert hash_calls.count(UNIT) == BASE * 4 // UNIT  # the base read again: nothing proven
    finally:
        os.close(ring)
    import time

    deadline = time.monotonic() + 10
    while write_tracker._pinned_kib() and time.monotonic() < deadline:  # the ring is torn down in the background
        time.sleep(0.05)
    shardckpt.save(sd, tmp_path / "step-5", incremental=True, incremental_unit=UNIT)
    hash_calls.clear()
    shardckpt.save(sd, tmp_path / "step-6", incremental=True, incremental_unit=UNIT)
    assert UNIT not in hash_calls  # closed: tracked again
    assert_bits(shardckpt.load_full(tmp_path / "step-6"), sd)


def test_a_zapped_range_saves_its_zeros_without_a_spurious_error(tmp_path):
    sd = state()
    for step in (1, 2):
        shardckpt.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.madvise(ctypes.c_void_p(sd["base"].data_ptr() + 2 * UNIT), ctypes.c_size_t(UNIT), 4) == 0
    want = snapshot(sd)
    assert not want["base"][2 * UNIT // 4:3 * UNIT // 4].any()
    shardckpt.save(sd, tmp_path / "step-3", incremental=True, incremental_unit=UNIT)
    shardckpt.save(sd, tmp_path / "step-4", incremental=True, incremental_unit=UNIT)
    assert_bits(shardckpt.load_full(tmp_path / "step-4"), want)


@pytest.mark.parametrize("incremental", [False, True])
def test_a_saved_storage_can_still_be_freed_by_resizing(tmp_path, incremental):
    """FSDP-style code frees a parameter's memory with ``untyped_storage().resize_(0)``: a save must not pin it."""
    t = torch.randn(BASE)
    for step in (1, 2):
        shardckpt.save({"w": t}, tmp_path / f"step-{step}", incremental=incremental, overwrite=True)
    t.untyped_storage().resize_(0)


def test_incompressible_units_save_with_zstd(tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {"noise": torch.randint(0, 256, (BASE * 4,), dtype=torch.uint8, generator=g)}
    for step in (1, 2):
        shardckpt.save(sd, tmp_path / f"step-{step}", incremental=True, incremental_unit=UNIT, compress="zstd")
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), sd)


def test_a_thread_writing_during_sync_saves_never_commits_a_torn_or_unreadable_unit(tmp_path):
    """Each committed step holds, unit by unit, bytes memory held at one instant; a save that saw a change raised.
    (CI, 62a2084, under load: a unit 66 ... 65 committed: the writer thread preempted mid-memset; see _one_instant.)"""
    import threading
    import time

    w = page_aligned(torch.zeros(BASE))
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            k = k % 250 + 1
            for u in (1, 5, 9):
                ctypes.memset(w.data_ptr() + u * UNIT, k, UNIT)

    thread = threading.Thread(target=writer)
    thread.start()
    committed, end = [], time.monotonic() + 3
    try:
        while time.monotonic() < end:
            path = tmp_path / f"step-{len(committed) + 1000}"
            try:
                shardckpt.save({"w": w}, path, incremental=True, incremental_unit=UNIT)
                committed.append(path)
            except shardckpt.CheckpointError as e:
                assert "changed while it was being saved" in str(e)
                shutil.rmtree(path, ignore_errors=True)
                committed.append(None)
    finally:
        stop.set()
        thread.join()
    for path in filter(None, committed):
        got = shardckpt.load_full(path)["w"].view(torch.uint8)
        for u in (1, 5, 9):
            assert _one_instant(got[u * UNIT:(u + 1) * UNIT]), f"{path}: unit {u} is torn"


def _one_instant(unit: torch.Tensor) -> bool:
    """Whether ``unit`` held these bytes at one instant: one value, or a memset of the next value in progress (its
    front new, its back old: the writer thread preempted mid-memset leaves memory so while a save reads it, and a save
    stores what memory holds). Bytes read at two times would show the old value before the new one."""
    values = torch.unique_consecutive(unit)
    return len(values) == 1 or (len(values) == 2 and int(values[0]) == int(values[1]) % 250 + 1)
