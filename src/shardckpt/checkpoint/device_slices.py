"""A device tensor's bytes written without a whole host copy: slices through two reused pinned buffers.

A synchronous ``save`` of CUDA tensors used to copy each piece whole into fresh pageable host memory before any of
it was written. On an H200 that copy ran at 1.4 GB/s (first-touch page faults, and the driver's own bounce through
pinned memory) against 55 GB/s into pinned memory, so the copy, not the disk, set the time of a save (8 GiB: 5.9 s
of copying before 5.2 s of writing). Here the writer thread takes the piece a slice at a time instead: each slice
is copied into one of two pinned buffers on a side stream while the previous one is checksummed and written, so
the copy hides under the write and host memory stays two slices per writer thread.

Only what a synchronous save keeps on the device comes here (``keeps_on_device``): a contiguous tensor without
conj/neg bits whose region is one run of the saved tensor (so that its checksum term follows from its block CRCs).
``stage`` synchronises the device first, so that the side stream reads the values the caller saw.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterator

import torch

from shardckpt.regions import Region, contiguous_runs

SLICE_BYTES = 16 << 20  # one writer call (``checkpoint.writer.WRITE_SIZE``): slices are whole checksum blocks


def keeps_on_device(data: torch.Tensor, region: Region, shape: tuple[int, ...]) -> bool:
    """Whether a synchronous save writes ``data`` straight from its device (see the module docstring)."""
    if data.device.type != "cuda" or not data.numel() or not data.is_contiguous() or data.is_conj() \
            or data.is_neg():
        return False
    return len(list(itertools.islice(contiguous_runs(region, shape), 2))) == 1


def device_slices(data: torch.Tensor) -> Callable[[int, int], Iterator[torch.Tensor]]:
    """``slices(block, first)`` for ``checkpoint.writer.StreamedPiece``: ``data``'s elements from ``first`` on, as
    host tensors of whole ``block``s (but the last), each valid until the next one is asked for."""
    flat = data.reshape(-1)  # a view: ``data`` is contiguous
    pinned = flat.device.type == "cuda"

    def slices(block: int, first: int) -> Iterator[torch.Tensor]:
        step = max(SLICE_BYTES // block, 1) * block // flat.element_size()
        total = flat.numel()
        if first >= total:
            return
        size = min(step, total - first)
        buffers = [torch.empty(size, dtype=flat.dtype, pin_memory=pinned) for _ in range(2)]
        stream = torch.cuda.Stream(device=flat.device) if pinned else None

        def start(which: int, lo: int) -> tuple[torch.Tensor, object]:
            buf = buffers[which][:min(step, total - lo)]
            if stream is None:
                return buf.copy_(flat[lo:lo + buf.numel()]), None
            with torch.cuda.stream(stream):
                buf.copy_(flat[lo:lo + buf.numel()], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            return buf, done

        which, lo = 0, first
        current = start(which, lo)
        while current is not None:
            buf, done = current
            after = lo + buf.numel()
            # The next slice goes into the other buffer while this one is written.
            current = start(1 - which, after) if after < total else None
            if done is not None:
                done.synchronize()
            yield buf
            which, lo = 1 - which, after

    return slices
