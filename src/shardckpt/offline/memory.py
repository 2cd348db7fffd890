"""``--memory-limit`` of ``convert`` and ``export``: a bound on the process's peak resident memory.

What the process already holds when the copying starts (Python, torch, the reader's manifest and indexes,
the plan: ~265 MiB of it is Python and torch alone) is spent first; the rest is the budget for the buffers
the command fills and drains a slice at a time. A limit below what is already held leaves the smallest
buffers (a checksum block each) and a warning: the limit cannot be met then, and the command says so
rather than refusing to run. Without a limit (the default) the buffers are ``DEFAULT_BUFFER_BYTES``,
whatever the process holds: a default never warns (a 512 MiB default did, in any process already past it:
a notebook, a test run, a training job).
"""
from __future__ import annotations

import os
import warnings

DEFAULT_MEMORY_LIMIT: int | None = None  # no limit: buffers of DEFAULT_BUFFER_BYTES
DEFAULT_BUFFER_BYTES = 256 << 20  # in a fresh CLI process (~265 MiB), about what the old 512 MiB limit left


def resident_bytes() -> int | None:
    """This process's resident memory now, in bytes; None where the platform does not say (no ``/proc``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def buffer_budget(memory_limit: int | None, what: str, reserve: int = 0) -> int:
    """The bytes of buffers that keep this process's resident memory within ``memory_limit``: the limit less
    what the process holds now and ``reserve`` (what reads will hold besides the buffers: ``read_reserve``); 0,
    with a warning, when it already holds that much. No limit: ``DEFAULT_BUFFER_BYTES``."""
    if memory_limit is None:
        return DEFAULT_BUFFER_BYTES
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
