"""Proving that a CPU tensor's bytes were not written since an earlier read, without reading them
(docs/design/incremental.md, 5.3): the kernel's page-write record (``checkpoint.page_writes``) in epochs.

``begin()`` starts an epoch: every tracked page's writes since the last epoch are collected (and the pages protected
again) and stamped with the new epoch number. ``protect(t)`` makes sure every page under ``t`` is tracked (a page
tracked only now counts as written in this epoch) and returns a ``Mark``: bytes read from ``t`` after it hold their
value at the mark. ``unwritten(mark, t, lo, hi)`` later says that bytes ``[lo, hi)`` of ``t`` (offsets from its
data pointer) still hold that value: the same storage, alive all along (its memory never freed and reused), every
page under the range tracked all along, and none stamped after the mark's epoch. A write after the mark is stamped
with a later epoch at the next ``begin()``; a write before it was read with the bytes. Each answer errs only towards
"written".

What the kernel does not see, this cannot: memory another process or a device writes through its own mapping.
So only private anonymous memory is tracked (not shared memory, not a file mapping), never pinned memory (devices
write it directly), and callers also require the tensor's version counter unchanged (a torch op that writes it,
through any route, bumps that).
"""
from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from shardckpt.checkpoint.page_writes import PAGE, PageWrites, open_page_writes

MIN_BYTES = 256 << 10  # smaller tensors are hashed (tracking one costs about what hashing 64 KiB does)
ENV = "SHARDCKPT_WRITE_TRACKING"  # "0" turns tracking off (every unit is hashed)


@dataclass(frozen=True)
class Mark:
    """The epoch of ``t``'s protection, its storage (a weak reference: a storage freed and its memory reused fails
    the check), and the bytes it covered."""

    epoch: int
    storage: StorageWeakRef
    cdata: int
    address: int
    nbytes: int


@dataclass
class _Region:
    lo: int
    hi: int
    owner: StorageWeakRef  # the storage it was made for: unregistered once that is freed
    stamps: np.ndarray  # per page: the last epoch that saw it written (or the region made)


def _span(address: int, nbytes: int) -> tuple[int, int]:
    return address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE


def _mappings() -> list[tuple[int, int, bool]]:
    """This process's mappings, by address: (start, end, private and anonymous)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[1][3] == "p" and fields[4] == "0"))
    return out


def _private_anonymous(mappings: list[tuple[int, int, bool]], lo: int, hi: int) -> bool:
    """Whether every byte of ``[lo, hi)`` lies in private anonymous mappings (no other mapping of the same pages:
    not shared memory, not a file, which would show through a private mapping's unwritten pages)."""
    at = lo
    for start, end, private in mappings[max(bisect.bisect_right(mappings, (lo, 1 << 64)) - 1, 0):]:
        if end <= at:
            continue
        if start > at or not private:
            return False
        at = end
        if at >= hi:
            return True
    return False


class WriteTracker:
    def __init__(self, pages: PageWrites):
        self._pages = pages
        self._lock = threading.Lock()
        self._epoch = 0
        self._regions: list[_Region] = []  # disjoint, sorted by lo
        self._mappings: list[tuple[int, int, bool]] | None = None  # read once per epoch (per save), when needed

    def begin(self) -> None:
        with self._lock:
            self._epoch += 1
            self._mappings = None
            self._regions = [r for r in self._regions if self._refresh(r)]

    def _refresh(self, region: _Region) -> bool:
        if region.owner.expired():
            self._pages.unregister(region.lo, region.hi)
            return False
        # The owner is alive, so the pages under its bytes are mapped: a mapping made there anew (not registered)
        # fails the collect, and the region is forgotten.
        written = self._pages.collect(region.lo, region.hi)
        if written is None:
            return False
        for start, end in written:
            region.stamps[(start - region.lo) // PAGE:(end - region.lo) // PAGE] = self._epoch
        return True

    def protect(self, t: torch.Tensor) -> Mark | None:
        """Track every page under ``t``; None if ``t`` cannot be tracked (then nothing about it is proven)."""
        if not _trackable(t):
            return None
        storage = t.untyped_storage()
        lo, hi = _span(t.data_ptr(), t.nbytes)
        with self._lock:
            for start, end in self._gaps(lo, hi):
                if not self._add(start, end, storage):
                    return None
            return Mark(self._epoch, StorageWeakRef(storage), storage._cdata, t.data_ptr(), t.nbytes)

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
        region = _Region(lo, hi, StorageWeakRef(storage), np.full((hi - lo) // PAGE, self._epoch, dtype=np.int32))
        bisect.insort(self._regions, region, key=lambda r: r.lo)
        return True

    def unwritten(self, mark: Mark | None, t: torch.Tensor, lo: int, hi: int) -> bool:
        """Whether bytes ``[lo, hi)`` of ``t`` (from its data pointer) hold the value they had at ``mark``."""
        if mark is None or mark.storage.expired() or not t.is_cpu or t.untyped_storage()._cdata != mark.cdata:
            return False
        address = t.data_ptr()
        if not (mark.address <= address + lo and address + hi <= mark.address + mark.nbytes and lo < hi):
            return False
        start, end = _span(address + lo, hi - lo)
        with self._lock:
            at = start
            for region in self._overlapping(start, end):
                if region.lo > at:
                    return False
                stop = min(region.hi, end)
                if region.stamps[(at - region.lo) // PAGE:(stop - region.lo) // PAGE].max() > mark.epoch:
                    return False
                at = stop
            return at == end


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
