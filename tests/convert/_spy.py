"""What the native reader is asked to read, either way it is asked: ``read``'s requests, and ``read_flat``'s flat
reads (a convert's small chunks) that it copies itself (those it leaves go on to ``read``, and are told there)."""
from __future__ import annotations

from typing import Callable

from shardckpt.formats.native import NativeReader


def spy_reads(monkeypatch, told: Callable[[list[tuple[str, int]]], None]) -> None:
    """From now on, tell ``told`` the tensor and byte size of each read of every call that reads something."""
    real_read, real_flat = NativeReader.read, NativeReader.read_flat

    def read(self, requests):
        told([(r.tensor, r.dest.nbytes) for r in requests])
        return real_read(self, requests)

    def read_flat(self, reads, buffer):
        left = real_flat(self, reads, buffer)
        unread = set(left)
        done = [(r.tensor, r.region.numel * r.dtype.itemsize) for k, r in enumerate(reads) if k not in unread]
        if done:
            told(done)
        return left

    monkeypatch.setattr(NativeReader, "read", read)
    monkeypatch.setattr(NativeReader, "read_flat", read_flat)


def read_sizes(monkeypatch) -> list[int]:
    """The byte size of every read the native reader is given from now on (the list fills as it reads)."""
    seen: list[int] = []
    spy_reads(monkeypatch, lambda reads: seen.extend(n for _, n in reads))
    return seen
