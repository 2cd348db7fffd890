"""A byte-count progress bar (tqdm) on stderr, shown only on a terminal and not with --quiet.

The library reports progress as ``progress(done_bytes, total_bytes)`` callbacks; this adapts them to one
tqdm bar, created at the first call, when the total is known."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, label: str, quiet: bool = False, stream=None):
        self._stream = stream or sys.stderr
        self._on = not quiet and self._stream.isatty()
        self._label = label
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self._on:
            return
        if self._bar is None:
            self._bar = tqdm(total=total, desc=self._label, file=self._stream, unit="B", unit_scale=True,
                             unit_divisor=1024, dynamic_ncols=True, leave=True)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
