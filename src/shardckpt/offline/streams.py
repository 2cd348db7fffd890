"""How ``convert`` moves values: each output chunk streamed from the source a slice at a time (``ReadOnDemand``,
cast on the way if asked) through slice buffers allocated once (``SliceBuffers``)."""
from __future__ import annotations

import contextlib
import functools
import queue
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from shardckpt.checkpoint.writer import StreamedPiece
from shardckpt.format.dtypes import itemsize
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.regions import FlatRange, Region

ALIGN = 64  # the cast slice's offset in a slice buffer (any element size divides it)


@dataclass(frozen=True)
class Output:
    """One output tensor: its name in the output, where its values come from, its stored dtype and shape."""

    name: str
    path: tuple
    source: TensorInfo
    dtype: torch.dtype



class SliceBuffers:
    """The writers' slice buffers, one per writer, allocated once and reused chunk after chunk: buffers freed
    and allocated again would leave their pages with the C allocator, which keeps the freed heap of each
    thread's arena (measured: +190 MiB over a 35 MiB budget at 2 GiB)."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = nbytes
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self.free.put(torch.empty(nbytes, dtype=torch.uint8))

    @contextlib.contextmanager
    def take(self, needed: int) -> Iterator[torch.Tensor]:
        """A buffer of at least ``needed`` bytes (a one-off one when a limit too small for one block asks more)."""
        if needed > self.nbytes:
            yield torch.empty(needed, dtype=torch.uint8)
            return
        buffer = self.free.get()
        try:
            yield buffer
        finally:
            self.free.put(buffer)


class ReadOnDemand(Mapping[str, StreamedPiece]):
    """A rank's pieces, each streamed from the source (and cast) a slice at a time as the writer asks for it,
    through one of ``buffers`` (the slice as read, and as cast), at least one checksum block of the output."""

    def __init__(self, reader: CheckpointReader, outputs: dict[str, Output],
                 place: Callable[[Output], tuple[Region, bool]], tick: Callable[[int], None],
                 buffers: SliceBuffers):
        self.reader, self.outputs, self.place, self.tick, self.buffers = reader, outputs, place, tick, buffers

    def __getitem__(self, name: str) -> StreamedPiece:
        output = self.outputs[name]
        region, _ = self.place(output)
        if not isinstance(region, FlatRange):  # every placement convert makes is one run of the tensor
            raise AssertionError(f"{name!r}: output region {region} is not a flat range")
        return StreamedPiece(name, output.dtype, tuple(output.source.shape), region,
                             functools.partial(self._slices, output, region))

    def stream(self, output: Output, region: FlatRange) -> Iterator[torch.Tensor]:
        """``region`` of ``output`` in as few slices as the buffers hold (``offline.dcp_output``'s chunks: one)."""
        return self._slices(output, region, itemsize(output.dtype), 0)

    def _slices(self, output: Output, region: FlatRange, block: int, first: int) -> Iterator[torch.Tensor]:
        region = FlatRange(region.start + first, region.stop)  # the elements before are kept (offline.resume)
        if not region.numel:
            return
        source, cast = output.source.dtype, output.dtype
        casts = cast != source
        per_element = itemsize(source) + (itemsize(cast) if casts else 0)
        block_elements = max(1, block // itemsize(cast))  # a block is a whole number of elements (format.index)
        count = max(1, (self.buffers.nbytes - ALIGN) // per_element // block_elements) * block_elements
        count = min(count, region.numel)
        cast_at = -(-count * itemsize(source) // ALIGN) * ALIGN
        with self.buffers.take(cast_at + count * itemsize(cast) if casts else count * itemsize(source)) as buffer:
            for lo in range(region.start, region.stop, count):
                n = min(count, region.stop - lo)
                part = buffer[:n * itemsize(source)].view(source)
                self.reader.read([ReadRequest(output.source.name, FlatRange(lo, lo + n), part)])
                if casts:
                    part = buffer[cast_at:cast_at + n * itemsize(cast)].view(cast).copy_(part)
                self.tick(part.nbytes)
                yield part

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)
