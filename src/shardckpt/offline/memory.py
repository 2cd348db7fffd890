"""``--memory-limit`` of ``convert`` and ``export``, and the slice buffers their writes stream through: one budget,
one class (``SliceBuffers``), whatever the output format.

What the process already holds when the copying starts (Python, torch, the reader's manifest and indexes,
the plan: ~265 MiB of it is Python and torch alone) is spent first; the rest is the budget for the buffers
the command fills and drains a slice at a time. A limit below what is already held leaves the smallest
buffers (a checksum block each) and a warning: the limit cannot be met then, and the command says so
rather than refusing to run. Without a limit (the default) the buffers are a fixed size (``DEFAULT_BUFFER_BYTES``
for convert), whatever the process holds: a default never warns (a 512 MiB default did, in any process already
past it: a notebook, a test run, a training job).
"""
from __future__ import annotations

import contextlib
import os
import queue
import warnings
from typing import Iterator

import torch

DEFAULT_BUFFER_BYTES = 256 << 20  # in a fresh CLI process (~265 MiB), about what the old 512 MiB limit left
ALIGN = 64  # the smallest buffer, and where a cast slice starts in one (any element size divides it)


def resident_bytes() -> int | None:
    """This process's resident memory now, in bytes; None where the platform does not say (no ``/proc``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def buffer_budget(memory_limit: int | None, what: str, reserve: int = 0, default: int = DEFAULT_BUFFER_BYTES) -> int:
    """The bytes of buffers that keep this process's resident memory within ``memory_limit``: the limit less
    what the process holds now and ``reserve`` (what reads will hold besides the buffers: ``read_reserve``); 0,
    with a warning, when it already holds that much. No limit: ``default``."""
    if memory_limit is None:
        return default
    held = resident_bytes()
    if held is None:
        return max(0, memory_limit - reserve)
    held += reserve
    if held >= memory_limit:
        warnings.warn(f"memory limit {memory_limit / 2**20:.0f} MiB for {what} is below the {held / 2**20:.0f} "
                      "MiB this process already holds (Python, torch, the plan); using the smallest buffers",
                      RuntimeWarning, stacklevel=3)
        return 0
    return memory_limit - held


def read_reserve(reader: object, reads_at_once: int) -> int:
    """What ``reads_at_once`` concurrent reads from ``reader`` hold besides their destinations: its
    ``transient_read_bytes`` (memory-mapped readers: the file pages a read has touched and not yet given back)."""
    return int(getattr(reader, "transient_read_bytes", 0)) * reads_at_once


class SliceBuffers:
    """The writers' slice buffers, one per writer thread, allocated once and reused chunk after chunk: buffers freed
    and allocated again would leave their pages with the C allocator, which keeps the freed heap of each
    thread's arena (measured: +190 MiB over a 35 MiB budget at 2 GiB)."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = nbytes
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self.free.put(torch.empty(nbytes, dtype=torch.uint8))

    @classmethod
    def within(cls, budget: int, count: int, largest: int, smallest: int = ALIGN) -> SliceBuffers:
        """``count`` buffers sharing ``budget`` bytes (``buffer_budget``), none larger than ``largest`` (what one
        slice can need: a limit above it would only allocate what is never used: 64 GiB asked of a small
        checkpoint was 32 GiB allocated), none smaller than ``smallest``."""
        return cls(count, max(smallest, min(budget // max(1, count), largest)))

    @contextlib.contextmanager
    def take(self, needed: int) -> Iterator[torch.Tensor]:
        """A buffer of at least ``needed`` bytes (a one-off one when a limit too small for one block asks more)."""
        if needed > self.nbytes:
            yield torch.empty(needed, dtype=torch.uint8)
            return
        buffer = self.free.get()
        try:
            yield buffer
        finally:
            self.free.put(buffer)
