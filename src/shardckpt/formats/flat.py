"""Reads of flat ranges of tensors, as stored, into one byte buffer: what ``convert`` asks for its small chunks
(``offline.streams.FileRuns``), many per call. A reader that can (shardckpt's own: ``formats.native.flat_reads``)
copies them into the buffer's bytes directly, with no tensor and no checked request per range: a typed view and
a ``check_request`` cost a conversion of many small tensors a fifth of its time. The ranges it leaves, and every
range of any other reader, go through ``read`` as typed views of the buffer."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from shardckpt.format.dtypes import itemsize
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.regions import FlatRange


class FlatRead(NamedTuple):
    """Elements ``region`` of tensor ``tensor``, of its stored ``dtype`` (not cast), to bytes ``[at, at + n)`` of
    the buffer; ``at`` is a multiple of the dtype's size."""

    tensor: str
    region: FlatRange
    dtype: torch.dtype
    at: int


def read_flat(reader: CheckpointReader, reads: Sequence[FlatRead], buffer: torch.Tensor) -> None:
    """Fill ``buffer`` (CPU, uint8, contiguous) with every read's elements, each at its ``at``: through the reader's
    ``read_flat(reads, buffer)`` where it has one (it checks them with ``check_flat_reads`` and answers with the
    positions of the reads it left), else as typed views through ``read``. Bad requests raise before anything is
    read, as ``read``'s do."""
    fast = getattr(reader, "read_flat", None)
    if fast is None:
        check_flat_reads(reads, buffer)
        rest = reads
    else:
        rest = [reads[i] for i in fast(reads, buffer)]
    if rest:
        reader.read(_typed(rest, buffer))


def check_flat_reads(reads: Sequence[FlatRead], buffer: torch.Tensor) -> None:
    """``ValueError`` unless ``buffer`` is contiguous CPU uint8 memory, aligned for every dtype, and each read's bytes
    lie inside it at a multiple of its dtype's size (a reader copies to these addresses as they are)."""
    if buffer.dtype != torch.uint8 or not buffer.is_cpu or not buffer.is_contiguous():
        raise ValueError(f"flat reads go to a contiguous CPU uint8 buffer, not {buffer.dtype} on {buffer.device}")
    if buffer.data_ptr() % 16:  # (every dtype's view of it at a multiple of its size is aligned)
        raise ValueError("flat reads go to a buffer aligned to 16 bytes")
    size = buffer.numel()
    for r in reads:
        n = itemsize(r.dtype)
        if type(r.region) is not FlatRange or r.at < 0 or r.at % n or r.at + r.region.numel * n > size:
            raise ValueError(f"flat read of {r.tensor!r} {r.region} to byte {r.at} does not fit a {size}-byte buffer")


def _typed(reads: Sequence[FlatRead], buffer: torch.Tensor) -> list[ReadRequest]:
    """Each read as a request whose destination is its bytes of ``buffer`` as its dtype."""
    whole: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype: one view of it is one call
    requests = []
    for r in reads:
        n = itemsize(r.dtype)
        typed = whole.get(r.dtype)
        if typed is None:
            typed = whole[r.dtype] = buffer[:buffer.numel() // n * n].view(r.dtype)
        dest = typed.as_strided((r.region.numel,), (1,), typed.storage_offset() + r.at // n)
        requests.append(ReadRequest(r.tensor, r.region, dest))
    return requests
