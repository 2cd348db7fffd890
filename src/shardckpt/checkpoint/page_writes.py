"""Which pages of this process were written, as the kernel records it (Linux 6.7+): a userfaultfd in asynchronous
write-protect mode (``UFFD_FEATURE_WP_ASYNC``) and ``PAGEMAP_SCAN`` on ``/proc/self/pagemap``.

A registered range's pages are write-protected by a scan; the first write to a protected page, by any thread of this
process or by the kernel on its behalf (``read(2)`` into it), clears the protection without a signal or a handler
thread, and the next scan reports that page as written and protects it again, atomically per page. Nothing reads the
pages themselves. Used by ``checkpoint.write_tracker``; every call here is one ioctl.

Unavailable (``open_page_writes`` returns None) off Linux, before 6.7, or where userfaultfd is refused: callers then
read and hash as before.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_USERFAULTFD = {"x86_64": 323, "aarch64": 282}  # syscall numbers
_USER_MODE_ONLY = 1  # userfaultfd(2) flag: allowed without CAP_SYS_PTRACE (vm.unprivileged_userfaultfd=0)
_UFFD_API = 0xAA
_WP_UNPOPULATED, _WP_ASYNC = 1 << 13, 1 << 15  # UFFD_FEATURE_*
_MODE_WP = 1 << 1  # UFFDIO_REGISTER_MODE_WP
_WP_MATCHING, _CHECK_WPASYNC = 1 << 0, 1 << 1  # PM_SCAN_* flags
_IS_WRITTEN, _IS_PRESENT, _IS_PFNZERO = 1 << 1, 1 << 3, 1 << 5  # PAGE_IS_* categories
_VEC = 512  # page_region entries per scan call


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Scan(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages", "category_inverted",
        "category_mask", "category_anyof_mask", "return_mask")]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_UFFDIO_API = _iowr(_UFFD_API, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(_UFFD_API, 0x00, ctypes.sizeof(_Register))
_UFFDIO_UNREGISTER = (2 << 30) | (ctypes.sizeof(_Range) << 16) | (_UFFD_API << 8) | 0x01  # _IOR
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_Scan))


class PageWrites:
    """This process's userfaultfd (async write-protect) and pagemap. Ranges are page-aligned ``[lo, hi)``."""

    def __init__(self, libc: ctypes.CDLL, uffd: int, pagemap: int):
        self._libc, self._uffd, self._pagemap = libc, uffd, pagemap
        self._vec = (_PageRegion * _VEC)()

    def _ioctl(self, fd: int, request: int, arg: ctypes.Structure) -> int:
        return self._libc.ioctl(fd, ctypes.c_ulong(request), ctypes.byref(arg))

    def register(self, lo: int, hi: int) -> bool:
        """Track writes to ``[lo, hi)``; its pages count as written until the first ``collect``."""
        return self._ioctl(self._uffd, _UFFDIO_REGISTER, _Register(_Range(lo, hi - lo), _MODE_WP, 0)) == 0

    def unregister(self, lo: int, hi: int) -> None:
        self._ioctl(self._uffd, _UFFDIO_UNREGISTER, _Range(lo, hi - lo))  # a range already unmapped: nothing to do

    def _scan(self, lo: int, hi: int, flags: int, category: int, inverted: int = 0,
              anyof: int = 0) -> list[tuple[int, int]] | None:
        out: list[tuple[int, int]] = []
        at = lo
        while at < hi:
            arg = _Scan(ctypes.sizeof(_Scan), flags, at, hi, 0, ctypes.addressof(self._vec), _VEC, 0, inverted,
                        category, anyof, category | anyof)
            n = self._ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            if n < 0:
                return None
            out.extend((self._vec[i].start, self._vec[i].end) for i in range(n))
            if arg.walk_end <= at:
                return None  # no progress: never loop
            at = arg.walk_end
        return out

    def collect(self, lo: int, hi: int) -> list[tuple[int, int]] | None:
        """The page ranges of ``[lo, hi)`` written since they were last protected, each protected again in the same
        step; None if any part is not registered (then some pages may have been protected and their writes lost:
        the caller forgets the whole range)."""
        return self._scan(lo, hi, _WP_MATCHING | _CHECK_WPASYNC, _IS_WRITTEN)

    def discarded(self, lo: int, hi: int) -> list[tuple[int, int]] | None:
        """The page ranges of ``[lo, hi)`` not mapped to a page of their own: not present (never touched, swapped
        out, migrating, or zapped by ``madvise(MADV_DONTNEED)``, which leaves zeros) or mapping the shared zero page
        (a zapped page read since). A zap of private anonymous memory also shows as written here (6.18); a page
        whose protection a marker kept would not, so these count as changed too. Nothing is protected."""
        return self._scan(lo, hi, 0, 0, inverted=_IS_PRESENT, anyof=_IS_PRESENT | _IS_PFNZERO)

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            try:
                os.close(fd)
            except OSError:
                pass


def open_page_writes() -> PageWrites | None:
    """This process's ``PageWrites``, or None where the kernel cannot record writes so."""
    number = _USERFAULTFD.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
    if uffd < 0:
        return None
    api = _Api(_UFFD_API, _WP_UNPOPULATED | _WP_ASYNC, 0)
    if libc.ioctl(uffd, ctypes.c_ulong(_UFFDIO_API), ctypes.byref(api)) != 0 or \
            api.features & (_WP_UNPOPULATED | _WP_ASYNC) != _WP_UNPOPULATED | _WP_ASYNC:
        os.close(uffd)
        return None
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(uffd)
        return None
    pages = PageWrites(libc, uffd, pagemap)
    probe = ctypes.create_string_buffer(4 * PAGE)  # PAGEMAP_SCAN (6.7) answers on a range nothing registered
    lo = -(-ctypes.addressof(probe) // PAGE) * PAGE
    if pages._scan(lo, lo + PAGE, 0, _IS_WRITTEN) is None:
        pages.close()
        return None
    return pages
