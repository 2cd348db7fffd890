"""What the native reader is asked to read, for tests of memory bounds."""
from __future__ import annotations

from shardckpt.formats.native import NativeReader


def read_sizes(monkeypatch) -> list[int]:
    """The byte size of every request the native reader is given from now on (the list fills as it reads)."""
    seen: list[int] = []
    real = NativeReader.read

    def spy(self, requests):
        seen.extend(r.dest.nbytes for r in requests)
        return real(self, requests)

    monkeypatch.setattr(NativeReader, "read", spy)
    return seen
