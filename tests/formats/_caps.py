"""A cap on this process's address space for the length of a test, so that a reader that allocates without bound
fails the test with a ``MemoryError`` instead of taking the machine's memory."""
from __future__ import annotations

import contextlib
import resource


def address_space() -> int:
    """This process's address space now, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_cap(extra: int = 1 << 30):
    """Allocation beyond ``extra`` bytes more than this process maps now fails (``MemoryError``) while it lasts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space() + extra
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
