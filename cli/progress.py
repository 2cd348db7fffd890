"""A byte-count progress bar on stderr, shown only on a terminal and not with --quiet."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, quiet: bool = False, stream=None):
        self._stream = stream or sys.stderr
        self._on = not quiet and self._stream.isatty()
        self._label, self._last, self._start = label, 0.0, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self._on or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / max(now - self._start, 1e-9) / 2**20
        self._stream.write(f"\r{self._label} [{bar:<30}] {frac:6.1%} {done / 2**20:,.0f} MiB {rate:,.0f} MiB/s")
        self._stream.flush()

    def close(self) -> None:
        if self._on:
            self._stream.write("\n")
            self._stream.flush()
