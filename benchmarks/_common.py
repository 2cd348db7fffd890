"""Shared helpers for the benchmarks: page-cache dropping, RSS sampling, medians, formatting."""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")
_warned = False


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.path.exists("/proc/sys/vm/drop_caches")


def drop_caches() -> None:
    """``sync`` then drop the page cache (root only; warns once and only syncs otherwise)."""
    global _warned
    os.sync()
    if can_drop_caches():
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    elif not _warned:
        _warned = True
        print("WARNING: not root: cannot drop the page cache; 'cold' loads may be warm", file=sys.stderr)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a thread; ``peak`` is the high-water mark."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = rss_bytes()
            self.peak = max(self.peak, r)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        r = rss_bytes()
        self.peak = max(self.peak, r)

    @property
    def delta(self) -> int:
        return self.peak - self.base


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


class Timer:
    """Wall seconds (``s``) and this process's CPU seconds, all its threads (``cpu``)."""

    def __enter__(self) -> Timer:  # noqa: PYI034
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _gloo_rank(rank: int, world: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group on 127.0.0.1."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world, port, fn, args), nprocs=world, join=True)
