"""Progress callbacks: ``progress(done_bytes, total_bytes)``, as ``save``, ``load``, ``load_full`` and the
offline verbs take them. The first call may be ``(0, total)``, the last is ``(total, total)``; ``done`` never
goes down. A callback that raises fails the operation like any other error."""
from __future__ import annotations

import threading
from typing import Callable, Sequence

from shardckpt.formats.api import CheckpointReader, ReadRequest

ProgressCallback = Callable[[int, int], None]

READ_BATCH_BYTES = 64 << 20  # at least this many bytes per reader.read call when progress is reported
READ_REPORTS = 100  # about how many reports a large read gives


class Progress:
    """Bytes written so far, from the writer threads."""

    def __init__(self, total: int, report: ProgressCallback | None):
        self.total, self.report, self.done, self.lock = total, report, 0, threading.Lock()

    def begin(self) -> None:
        """Report ``(0, total)``: a caller with nothing to do (``total == 0``) still hears of its end."""
        if self.report is not None:
            self.report(0, self.total)

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.report is not None:
                self.report(self.done, self.total)


def read_reporting(reader: CheckpointReader, requests: Sequence[ReadRequest], progress: ProgressCallback | None) -> None:
    """``reader.read(requests)``, reporting the bytes filled to ``progress``: the requests are read in batches
    (each at least ``READ_BATCH_BYTES``, about 1/``READ_REPORTS`` of the total), a report after each, since a
    reader's ``read`` says nothing until it returns. Without ``progress``: one call, as before."""
    if progress is None:
        reader.read(requests)
        return
    total = sum(r.dest.nbytes for r in requests)
    batch_bytes = max(READ_BATCH_BYTES, total // READ_REPORTS)
    done, batch, batched = 0, [], 0
    progress(0, total)
    for i, request in enumerate(requests):
        batch.append(request)
        batched += request.dest.nbytes
        if batched >= batch_bytes or i == len(requests) - 1:
            reader.read(batch)
            done += batched
            progress(done, total)
            batch, batched = [], 0
