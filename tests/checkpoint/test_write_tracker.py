"""The write tracker (checkpoint.write_tracker): "unwritten since the mark" must never be said of bytes that changed,
whoever changed them; and it must be said of bytes nobody touched (else incremental saves read the frozen base)."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
import pytest
import torch

from shardckpt.checkpoint import write_tracker as wt
from shardckpt.checkpoint.page_writes import PAGE

N = (4 << 20) // 4  # 4 MiB of float32: many pages, above MIN_BYTES


def randn(n: int) -> torch.Tensor:
    """``n`` random floats on pages of their own: in the heap, the allocator writes the pages at a tensor's edges
    (which the tracker rightly reports), and the tests here count pages exactly."""
    big = torch.randn(n + 2 * PAGE // 4)
    at = (-big.data_ptr() % PAGE) // 4
    return big[at:at + n]


@pytest.fixture
def tracker():
    t = wt.write_tracker()
    if t is None:
        pytest.skip("this kernel does not record page writes for us (userfaultfd async write-protect, Linux 6.7+)")
    return t


def marked(tracker, t):
    tracker.begin()
    mark = tracker.protect(t)
    assert mark is not None
    return mark


def whole(tracker, mark, t) -> bool:
    return tracker.unwritten(mark, t, 0, t.nbytes)


def test_untouched_bytes_are_proven_unwritten_across_epochs(tracker):
    t = randn(N)
    mark = marked(tracker, t)
    for _ in range(3):
        tracker.begin()
        assert whole(tracker, mark, t)
    _ = t.sum()  # reads do not count
    tracker.begin()
    assert whole(tracker, mark, t)


def _torch_add(t):
    t[12345] += 1


def _numpy(t):
    t.numpy()[777_777] = 5.0


def _memset(t):
    ctypes.memset(t.data_ptr() + 3 * PAGE + 5, 0xAB, 1)


def _data_alias(t):
    t.data[1_000_000].fill_(3.0)


def _kernel_read_into(t):
    r, w = os.pipe()
    os.write(w, b"\x01" * 16)
    os.close(w)
    os.readv(r, [memoryview(t.numpy()).cast("B")[40_000:40_016]])
    os.close(r)


def _other_thread(t):
    th = threading.Thread(target=lambda: t.numpy().__setitem__(500_000, 9.0))
    th.start()
    th.join()


def _same_value(t):
    t.numpy()[42] = t.numpy()[42]  # a write of the same value still counts: the tracker sees writes, not values


@pytest.mark.parametrize("write", [_torch_add, _numpy, _memset, _data_alias, _kernel_read_into, _other_thread,
                                   _same_value])
def test_every_kind_of_write_is_seen(tracker, write):
    t = randn(N)
    mark = marked(tracker, t)
    write(t)
    tracker.begin()
    assert not whole(tracker, mark, t)
    tracker.begin()
    assert not whole(tracker, mark, t)  # stamped for good: a later epoch does not forget it


def test_a_write_dirties_only_the_pages_it_touched(tracker):
    t = randn(N)
    mark = marked(tracker, t)
    at = 1 << 20  # byte offset of the write
    ctypes.memset(t.data_ptr() + at, 1, 1)
    tracker.begin()
    assert not tracker.unwritten(mark, t, at - 64, at + 64)
    assert tracker.unwritten(mark, t, 0, at // 2)
    assert tracker.unwritten(mark, t, at + 2 * PAGE, t.nbytes)


def test_a_new_mark_starts_clean_after_a_write(tracker):
    t = randn(N)
    old = marked(tracker, t)
    t.numpy()[0] = 1.0
    tracker.begin()
    new = tracker.protect(t)
    tracker.begin()
    assert whole(tracker, new, t) and not whole(tracker, old, t)


def test_a_freed_storage_is_never_proven_even_at_the_same_address(tracker):
    t = randn(N)
    mark = marked(tracker, t)
    address = t.data_ptr()
    del t
    u = torch.zeros(N)  # often the same address (glibc reuses the mapping's place)
    tracker.begin()
    assert not whole(tracker, mark, u)
    if u.data_ptr() == address:  # the storage's identity, not the address, decides
        assert not tracker.unwritten(mark, u, 0, PAGE)


def test_another_storage_or_range_outside_the_mark_is_not_proven(tracker):
    a, b = randn(N), randn(N)
    mark = marked(tracker, a)
    tracker.begin()
    assert not whole(tracker, mark, b)
    assert not tracker.unwritten(mark, a, 0, a.nbytes + 1)
    assert not tracker.unwritten(mark, a, 10, 10)
    assert not tracker.unwritten(None, a, 0, 16)


def test_memory_others_can_write_is_not_tracked(tracker, tmp_path):
    tracker.begin()
    shared = randn(N).share_memory_()
    assert tracker.protect(shared) is None
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (N * 4))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), N * 4, flags=mmap.MAP_PRIVATE)  # private, but the file shows through
        t = torch.frombuffer(m, dtype=torch.float32)
        assert tracker.protect(t) is None
        del t
        m.close()


def test_small_strided_and_device_less_tensors_are_not_tracked(tracker):
    tracker.begin()
    assert tracker.protect(torch.randn(1000)) is None
    assert tracker.protect(torch.randn(2048, 1024).t()) is None
    assert tracker.protect(torch.empty(0)) is None


def test_views_sharing_pages_each_see_the_others_writes(tracker):
    base = randn(2 * N)
    left, right = base[:N + 100], base[N + 100:]  # a page holds the end of one and the start of the other
    ml, mr = marked(tracker, left), tracker.protect(right)
    ctypes.memset(right.data_ptr(), 7, 4)  # the shared page, through the right view
    tracker.begin()
    assert not whole(tracker, ml, left) and not whole(tracker, mr, right)
    assert tracker.unwritten(ml, left, 0, N * 4 - 2 * PAGE)


def test_a_forked_child_starts_its_own_tracker(tracker):
    t = randn(N)
    mark = marked(tracker, t)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = 0
        try:
            child = wt.write_tracker()
            child_t = randn(N)
            child_mark = marked(child, child_t) if child is not None else None
            child_t.numpy()[3] = 1.0
            child.begin()
            ok = int(child is not tracker and not whole(child, child_mark, child_t))
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x01"
    os.close(r)
    os.waitpid(pid, 0)
    tracker.begin()
    assert whole(tracker, mark, t)  # the child's writes were its own copies


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(wt.ENV, "0")
    assert wt.write_tracker() is None


def test_a_numpy_view_of_the_same_memory_is_covered(tracker):
    t = randn(N)
    mark = marked(tracker, t)
    arr = np.frombuffer((ctypes.c_char * t.nbytes).from_address(t.data_ptr()), dtype=np.float32)
    arr[-1] = 0.5
    tracker.begin()
    assert not tracker.unwritten(mark, t, t.nbytes - 4, t.nbytes)


def _off_page(nbytes: int, offset: int = 100):
    """A float tensor whose storage starts ``offset`` bytes into a page (as a heap allocation does): its first and
    last pages also hold bytes that are not the storage's (here: the mapping's others)."""
    m = mmap.mmap(-1, nbytes + 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(memoryview(m)[offset:offset + nbytes], dtype=torch.float32)
    t.copy_(torch.randn(nbytes // 4))
    return m, t


def test_a_neighbour_writing_a_shared_page_does_not_hide_or_fake_a_change(tracker):
    m, t = _off_page(N * 4)
    mark = marked(tracker, t)
    assert mark.edges and sum(len(b) for _, b in mark.edges) < 2 * PAGE
    m[0:50] = b"\x07" * 50  # the neighbour's bytes on t's first page
    m[100 + N * 4 + 10] = 1  # and on its last page
    tracker.begin()
    assert whole(tracker, mark, t)  # t's own bytes there are as they were
    t[0] = t[0] + 1  # t's bytes on the shared first page
    tracker.begin()
    assert not tracker.unwritten(mark, t, 0, 4)
    assert tracker.unwritten(mark, t, 2 * PAGE, t.nbytes)  # the rest is untouched
    t[-1] = t[-1] + 1
    assert not tracker.unwritten(mark, t, t.nbytes - 4, t.nbytes)
    del t


def test_edge_bytes_that_changed_before_the_save_finished_are_not_trusted(tracker):
    m, t = _off_page(N * 4)
    mark = marked(tracker, t)
    before = t[0].item()
    t[0] = before + 1  # while the save reads t: the digest may hold either value
    confirmed = tracker.confirmed(mark, t)
    assert confirmed.edges is None
    t[0] = before  # restored: the bytes match the mark's, but the mark is no longer trusted for them
    tracker.begin()
    assert not tracker.unwritten(confirmed, t, 0, 4)
    assert not tracker.unwritten(confirmed, t, t.nbytes - 4, t.nbytes)  # the other edge: not trusted either
    assert tracker.unwritten(confirmed, t, 2 * PAGE, t.nbytes - 2 * PAGE)
    assert tracker.confirmed(marked(tracker, t), t).edges  # unchanged edges are kept
    del t


def test_written_own_pages_ignores_the_shared_ones(tracker):
    m, t = _off_page(N * 4)
    mark = marked(tracker, t)
    m[0:8] = b"\x01" * 8
    tracker.begin()
    assert not tracker.written_own_pages(mark, t, 0, t.nbytes)
    t[N // 2] = 0.0
    tracker.begin()
    assert tracker.written_own_pages(mark, t, 0, t.nbytes)
    del t


@pytest.mark.parametrize("then_read", [False, True])
def test_pages_discarded_under_a_live_tensor_are_not_unwritten(tracker, then_read):
    """madvise(MADV_DONTNEED) leaves zeros and no write (and a read after it maps the shared zero page)."""
    t = randn(N)
    mark = marked(tracker, t)
    libc = ctypes.CDLL(None, use_errno=True)
    at = t.data_ptr() + 8 * PAGE
    assert libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(2 * PAGE), 4) == 0  # MADV_DONTNEED
    if then_read:
        assert t[8 * PAGE // 4].item() == 0.0
    tracker.begin()
    assert not tracker.unwritten(mark, t, 8 * PAGE, 9 * PAGE)
    assert tracker.unwritten(mark, t, 0, 8 * PAGE) and tracker.unwritten(mark, t, 10 * PAGE, t.nbytes)


def test_memory_pinned_anywhere_in_the_process_pauses_tracking(tracker, monkeypatch):
    """``VmPin``: io_uring buffers or RDMA registrations whose fd is closed, registered away or held by another
    process still let the kernel write pinned pages without a fault."""
    t = randn(N)
    mark = marked(tracker, t)
    monkeypatch.setattr(wt, "_pinned_kib", lambda: 4)
    tracker.begin()
    assert tracker.protect(t) is None and not whole(tracker, mark, t)
    monkeypatch.setattr(wt, "_pinned_kib", lambda: 0)
    tracker.begin()
    assert whole(tracker, mark, t)  # its pages were protected all along: what the pins' faults did is stamped


def _three_touching(tracker):
    """Three tensors on whole pages of their own, end to end in one allocation: three regions that touch."""
    m = 64 * PAGE // 4
    big = randn(3 * m)
    parts = [big[i * m:(i + 1) * m] for i in range(3)]
    tracker.begin()
    marks = [tracker.protect(p) for p in parts]
    assert all(mark is not None for mark in marks)
    return parts, marks


def test_touching_regions_are_scanned_together_and_stamped_apart(tracker, monkeypatch):
    """Regions that touch end to end are collected in one scan; a write is still stamped only in the region, and
    only on the pages, it touched: at a boundary page, in the middle, and not at all."""
    parts, marks = _three_touching(tracker)
    scans = []
    real = tracker._pages.collect
    monkeypatch.setattr(tracker._pages, "collect", lambda lo, hi: scans.append((lo, hi)) or real(lo, hi))
    ctypes.memset(parts[0].data_ptr() + parts[0].nbytes - 1, 1, 1)  # a's last page, next to b's first
    ctypes.memset(parts[2].data_ptr() + 5 * PAGE, 1, 1)
    tracker.begin()
    lo, hi = parts[0].data_ptr(), parts[2].data_ptr() + parts[2].nbytes
    assert sum(1 for a, b in scans if a <= lo and hi <= b) == 1
    assert not any(lo < b and a < hi and not (a <= lo and hi <= b) for a, b in scans)  # not also one by one
    a, b, c = parts
    assert not whole(tracker, marks[0], a) and tracker.unwritten(marks[0], a, 0, a.nbytes - PAGE)
    assert whole(tracker, marks[1], b)
    assert not tracker.unwritten(marks[2], c, 5 * PAGE, 6 * PAGE)
    assert tracker.unwritten(marks[2], c, 0, 5 * PAGE) and tracker.unwritten(marks[2], c, 6 * PAGE, c.nbytes)


def test_a_failed_scan_forgets_every_region_of_its_run(tracker, monkeypatch):
    """A collect that fails part way may have protected some pages of the run, their writes unreported: none of
    the run's regions is trusted after it, though nothing wrote to two of them."""
    parts, marks = _three_touching(tracker)
    lo = parts[0].data_ptr()
    real = tracker._pages.collect
    monkeypatch.setattr(tracker._pages, "collect", lambda a, b: None if a <= lo < b else real(a, b))
    parts[1].numpy()[7] += 1
    tracker.begin()
    monkeypatch.setattr(tracker._pages, "collect", real)
    tracker.begin()
    assert not any(whole(tracker, mark, p) for mark, p in zip(marks, parts))
