"""Proving that a CPU tensor's bytes were not written since an earlier read, without reading them
(docs/design/incremental.md, 5.3): the kernel's page-write record (``checkpoint.page_writes``) in epochs.

``begin()`` starts an epoch: every tracked page's writes since the last epoch are collected (and the pages protected
again) and stamped with the new epoch number. ``protect(t)`` makes sure every page under ``t`` is tracked (a page
tracked only now counts as written in this epoch) and returns a ``Mark``: bytes read from ``t`` after it hold their
value at the mark. ``unwritten(mark, t, lo, hi)`` later says that bytes ``[lo, hi)`` of ``t`` (offsets from its
data pointer) still hold that value: the same storage, alive all along (its memory never freed and reused), every
page under the range tracked all along, and none stamped after the mark's epoch. A write after the mark is stamped
with a later epoch at the next ``begin()``; a write before it was read with the bytes. Each answer errs only towards
"written". The first and last pages of an allocation in the heap also hold the allocator's and other objects' bytes,
which others write all the time: ``t``'s bytes there (under a page each side) are kept in the mark and compared
instead (``confirmed(mark, t)`` once the save has read ``t``: kept only if they did not change meanwhile).

What the kernel does not see, this cannot: memory another process or a device writes through its own mapping.
So only private anonymous memory is tracked (not shared memory, not a file mapping), never pinned memory (devices
write it directly), and callers also require the tensor's version counter unchanged (a torch op that writes it,
through any route, bumps that).
"""
from __future__ import annotations

import bisect
import ctypes
import dataclasses
import itertools
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from shardckpt.checkpoint.page_writes import PAGE, PageWrites, open_page_writes

log = logging.getLogger("shardckpt")

MIN_BYTES = 256 << 10  # smaller tensors are hashed (tracking one costs about what hashing 64 KiB does)
ENV = "SHARDCKPT_WRITE_TRACKING"  # "0" turns tracking off (every unit is hashed)


Edges = tuple  # ((address, bytes), ...): a tensor's bytes on pages it shares with other memory


@dataclass(frozen=True)
class Mark:
    """The epoch of ``t``'s protection, its storage (a weak reference: a storage freed and its memory reused fails
    the check), the bytes it covered, and its bytes on pages shared with other memory, as read then (None once they
    were seen to change before the save had read the rest: ``confirmed``)."""

    tracker: int  # the tracker's serial: a mark of another tracker (a forked parent's) proves nothing here
    epoch: int
    storage: StorageWeakRef
    cdata: int
    address: int
    nbytes: int
    edges: Edges | None = None


def own_pages(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[lo, hi)`` of the whole pages that hold only bytes of ``t``'s storage (possibly empty). The
    pages around them hold the allocator's or other objects' bytes too, which others write: those pages' bytes of
    ``t`` (under a page each side) are compared, not tracked."""
    storage = t.untyped_storage()
    return -(-storage.data_ptr() // PAGE) * PAGE, (storage.data_ptr() + storage.nbytes()) // PAGE * PAGE


def _outside(lo: int, hi: int, own: tuple[int, int]) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` (addresses) outside ``own``."""
    parts = [(lo, min(hi, own[0])), (max(lo, own[1]), hi)] if own[0] < own[1] else [(lo, hi)]
    return [(a, b) for a, b in parts if a < b]


def _read_edges(t: torch.Tensor) -> Edges:
    return tuple((a, ctypes.string_at(a, b - a)) for a, b in _outside(t.data_ptr(), t.data_ptr() + t.nbytes,
                                                                        own_pages(t)))


@dataclass
class _Region:
    lo: int
    hi: int
    owner: StorageWeakRef  # the storage it was made for: unregistered once that is freed
    stamps: np.ndarray  # per page: the last epoch that saw it written (or the region made)
    discards: np.ndarray  # per page: the last epoch that saw it without a page of its own (``discarded``)


def _span(address: int, nbytes: int) -> tuple[int, int]:
    return address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE


def _mappings() -> list[tuple[int, int, bool, str]]:
    """This process's mappings, by address: (start, end, private and anonymous, name)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5].strip() if len(fields) > 5 else ""
            out.append((start, end, fields[1][3] == "p" and fields[4] == "0", name))
    return out


def _private_anonymous(mappings: list, lo: int, hi: int) -> bool:
    """Whether every byte of ``[lo, hi)`` lies in private anonymous mappings (no other mapping of the same pages:
    not shared memory, not a file, which would show through a private mapping's unwritten pages)."""
    at = lo
    for start, end, private, _ in mappings[max(bisect.bisect_right(mappings, (lo, 1 << 64)) - 1, 0):]:
        if end <= at:
            continue
        if start > at or not private:
            return False
        at = end
        if at >= hi:
            return True
    return False


_PINNING = ("/dev/infiniband/", "/dev/vfio/")  # devices whose users register (pin) memory for them to write


def _pins_possible() -> bool:
    """Whether this process may hold pages pinned for a device or the kernel to write without a fault: any memory
    counted as pinned (io_uring buffers or rings in user memory, RDMA registrations, even with their fd closed or
    held by another process), an io_uring with registered buffers, an RDMA or VFIO device open. Pinning for writing
    faults each page writable once, which the tracker sees; the writes through the pin after that are not seen. An
    io_uring without buffers (libuv's, which torch's TCPStore starts) reads into its own memory."""
    try:
        if _pinned_kib() > 0:  # io_uring buffers and rings, RDMA: counted even once their fd is closed or passed on
            return True
        fds = os.listdir("/proc/self/fd")
    except (OSError, ValueError):
        return True
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(_PINNING) or (target == "anon_inode:[io_uring]" and _registers_buffers(fd)):
                return True
        except OSError:
            continue  # closed meanwhile (the listing's own fd, say)
    return False


def _pinned_kib() -> int:
    """This process's memory pinned for devices and the kernel (``VmPin``, ``mm->pinned_vm``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmPin:"):
                return int(line.split()[1])
    return 1  # a kernel that does not say: assume some


def _registers_buffers(fd: str) -> bool:
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("UserBufs:"):
                return int(line.split()[1]) > 0
    return True  # a kernel that does not say: assume it does


_serials = itertools.count(1)


class WriteTracker:
    def __init__(self, pages: PageWrites):
        self._pages = pages
        self._serial = next(_serials)
        self._lock = threading.Lock()
        self._trusted = False  # no pinning in the process, as of the epoch's start
        self._epoch = 0
        self._regions: list[_Region] = []  # disjoint, sorted by lo
        self._mappings: list | None = None  # read once per epoch (per save), when a region is made

    def begin(self) -> None:
        with self._lock:
            self._epoch += 1
            self._mappings = None
            trusted = not _pins_possible()
            if self._trusted and not trusted:
                log.info("shardckpt: write tracking paused while this process has io_uring buffers, RDMA or VFIO "
                         "devices (they write pinned pages without a fault); unchanged tensors are hashed")
            self._trusted = trusted
            live = []
            for region in self._regions:
                if region.owner.expired():
                    self._pages.unregister(region.lo, region.hi)
                else:
                    live.append(region)
            self._regions = [r for run in _touching_runs(live) for r in self._refresh(run)]

    def _refresh(self, run: list[_Region]) -> list[_Region]:
        """Stamp the written and the discarded pages of regions that touch end to end, in one scan of each kind
        (adjacent allocations make long runs: one ioctl, not two per tensor). The owners are alive, so the pages
        under their bytes are mapped: a mapping made there anew (not registered) fails a scan, and the whole run is
        forgotten (a failed collect may have protected some of its pages, their writes unreported)."""
        lo, hi = run[0].lo, run[-1].hi
        written = self._pages.collect(lo, hi)
        discarded = self._pages.discarded(lo, hi) if written is not None else None
        if discarded is None:
            return []
        for region in run:
            for stamps, ranges in ((region.stamps, written), (region.discards, discarded)):
                for start, end in _clipped(ranges, region.lo, region.hi):
                    stamps[(start - region.lo) // PAGE:(end - region.lo) // PAGE] = self._epoch
        return run

    def protect(self, t: torch.Tensor) -> Mark | None:
        """Track every page under ``t``; None if ``t`` cannot be tracked (then nothing about it is proven)."""
        if not _trackable(t) or not self._trusted:
            return None
        storage = t.untyped_storage()
        lo, hi = _span(t.data_ptr(), t.nbytes)
        with self._lock:
            for start, end in self._gaps(lo, hi):
                if not self._add(start, end, storage):
                    return None
            epoch = self._epoch
        return Mark(self._serial, epoch, StorageWeakRef(storage), storage._cdata, t.data_ptr(), t.nbytes,
                    _read_edges(t))

    @staticmethod
    def confirmed(mark: Mark | None, t: torch.Tensor) -> Mark | None:
        """``mark``, once the save read what it needed of ``t``: its edge bytes kept only if they did not change
        meanwhile (else a digest taken in between may hold other edge bytes than the mark)."""
        if mark is None or mark.edges is None or _read_edges(t) == mark.edges:
            return mark
        return dataclasses.replace(mark, edges=None)

    def _gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        gaps, at = [], lo
        for region in self._overlapping(lo, hi):
            if region.lo > at:
                gaps.append((at, region.lo))
            at = max(at, region.hi)
        if at < hi:
            gaps.append((at, hi))
        return gaps

    def _overlapping(self, lo: int, hi: int) -> list[_Region]:
        i = bisect.bisect_right(self._regions, lo, key=lambda r: r.lo) - 1
        out = []
        for region in self._regions[max(i, 0):]:
            if region.lo >= hi:
                break
            if region.hi > lo:
                out.append(region)
        return out

    def _checked(self, lo: int, hi: int) -> bool:
        """Private anonymous memory, by this epoch's reading of the mappings (read again if they miss the range).
        A tensor a save protects existed when the save began, and its memory stays mapped as it was while it lives,
        so an earlier reading that covers it describes it."""
        if self._mappings is not None and _private_anonymous(self._mappings, lo, hi):
            return True
        self._mappings = _mappings()
        return _private_anonymous(self._mappings, lo, hi)

    def _add(self, lo: int, hi: int, storage: torch.UntypedStorage) -> bool:
        if not self._checked(lo, hi) or not self._pages.register(lo, hi):
            return False
        if self._pages.collect(lo, hi) is None:  # protects every page (the first collect reports them all)
            self._pages.unregister(lo, hi)
            return False
        pages = (hi - lo) // PAGE
        region = _Region(lo, hi, StorageWeakRef(storage), np.full(pages, self._epoch, dtype=np.int32),
                         np.full(pages, self._epoch, dtype=np.int32))
        bisect.insort(self._regions, region, key=lambda r: r.lo)
        return True

    def unwritten(self, mark: Mark | None, t: torch.Tensor, lo: int, hi: int, discards: bool = True) -> bool:
        """Whether bytes ``[lo, hi)`` of ``t`` (from its data pointer) hold the value they had at ``mark``: on the
        storage's own pages, none stamped after the mark (written, or with ``discards`` also seen without a page of
        their own: zero pages a read maps after a zap stay so); on pages shared with other memory, the same
        bytes."""
        if not self._valid(mark, t):
            return False
        address = t.data_ptr()
        if not (mark.address <= address + lo and address + hi <= mark.address + mark.nbytes and lo < hi):
            return False
        own = own_pages(t)
        inner = (max(address + lo, own[0]), min(address + hi, own[1]))
        if inner[0] < inner[1] and not self._unstamped(mark.epoch, *_span(inner[0], inner[1] - inner[0]), discards):
            return False
        return all(_same_bytes(mark.edges, a, b) for a, b in _outside(address + lo, address + hi, own))

    def written_own_pages(self, mark: Mark | None, t: torch.Tensor, lo: int, hi: int) -> bool:
        """Whether some of the storage's own pages under bytes ``[lo, hi)`` of ``t`` were stamped after ``mark``
        (seen written: not merely a neighbour's write on a shared page)."""
        own = own_pages(t)
        inner = (max(t.data_ptr() + lo, own[0]), min(t.data_ptr() + hi, own[1]))
        return self._valid(mark, t) and inner[0] < inner[1] and \
            not self._unstamped(mark.epoch, *_span(inner[0], inner[1] - inner[0]))

    def _valid(self, mark: Mark | None, t: torch.Tensor) -> bool:
        """A mark this tracker made, of ``t``'s storage still alive, while nothing in the process pins pages."""
        return mark is not None and mark.tracker == self._serial and self._trusted and t.is_cpu and \
            not mark.storage.expired() and t.untyped_storage()._cdata == mark.cdata

    def _unstamped(self, epoch: int, lo: int, hi: int, discards: bool = False) -> bool:
        """Every page of ``[lo, hi)`` (page-aligned: a partial page would be left out) tracked all along and none
        stamped written after ``epoch`` (nor, with ``discards``, seen discarded: zeros without a write)."""
        assert lo % PAGE == 0 and hi % PAGE == 0, (lo, hi)
        with self._lock:
            at = lo
            for region in self._overlapping(lo, hi):
                if region.lo > at:
                    return False
                a, b = (at - region.lo) // PAGE, (min(region.hi, hi) - region.lo) // PAGE
                if region.stamps[a:b].max() > epoch or (discards and region.discards[a:b].max() > epoch):
                    return False
                at = min(region.hi, hi)
            return at == hi


def _touching_runs(regions: list[_Region]) -> list[list[_Region]]:
    """``regions`` (sorted, disjoint) grouped into runs that touch end to end."""
    runs: list[list[_Region]] = []
    for region in regions:
        if runs and runs[-1][-1].hi == region.lo:
            runs[-1].append(region)
        else:
            runs.append([region])
    return runs


def _clipped(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint ``ranges`` inside ``[lo, hi)``."""
    first = max(bisect.bisect_right(ranges, (lo, lo)) - 1, 0)
    out = []
    for start, end in ranges[first:]:
        if start >= hi:
            break
        if end > lo:
            out.append((max(start, lo), min(end, hi)))
    return out


def _same_bytes(edges: Edges | None, lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` lies in one of ``edges`` and holds the same bytes now."""
    for at, before in edges or ():
        if at <= lo and hi <= at + len(before):
            return ctypes.string_at(lo, hi - lo) == before[lo - at:hi - at]
    return False


def _trackable(t: torch.Tensor) -> bool:
    return (t.is_cpu and t.nbytes >= MIN_BYTES and t.is_contiguous() and not t.is_shared()
            and not t.is_pinned())


_tracker: WriteTracker | None = None
_opened = False
_lock = threading.Lock()


def write_tracker() -> WriteTracker | None:
    """This process's tracker, or None where the kernel cannot record writes or ``SHARDCKPT_WRITE_TRACKING=0``."""
    global _tracker, _opened
    if os.environ.get(ENV, "1") == "0":
        return None
    with _lock:
        if not _opened:
            pages = open_page_writes()
            _tracker, _opened = (WriteTracker(pages) if pages is not None else None), True
        return _tracker


def _forget_in_child() -> None:
    """A forked child's mappings are not registered, and the inherited userfaultfd is the parent's: start over."""
    global _tracker, _opened, _lock
    if _tracker is not None:
        _tracker._pages.close()  # this process's copies of the descriptors only
    _tracker, _opened, _lock = None, False, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
