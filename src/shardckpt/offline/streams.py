"""How the offline verbs move values: each output tensor (``Output``) streamed from the source a slice at a time
(``ReadOnDemand``, cast on the way if asked) through the slice buffers (``offline.memory.SliceBuffers``), as the
``StreamedPiece``s every output writer takes: shardckpt chunks (``convert``), DCP chunks and safetensors files."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from shardckpt.checkpoint.writer import StreamedPiece
from shardckpt.format.dtypes import itemsize
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.offline.memory import ALIGN, SliceBuffers
from shardckpt.regions import FlatRange, Region


@dataclass(frozen=True)
class Output:
    """One output tensor: its name in the output, its path in the source's tree, the source tensor its values
    come from, and its stored dtype (the source's, or the cast)."""

    name: str
    path: tuple
    source: TensorInfo
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.source.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def source_dtype(self) -> torch.dtype:
        return self.source.dtype


def largest_slice(outputs: list[Output]) -> int:
    """The most bytes one slice buffer can need: a whole output tensor, as read and as cast."""
    return max((o.numel * (itemsize(o.source_dtype) + (itemsize(o.dtype) if o.dtype != o.source_dtype else 0))
                for o in outputs), default=0) + ALIGN


class ReadOnDemand(Mapping[str, StreamedPiece]):
    """Pieces, each streamed from the source (and cast) a slice at a time as the writer asks for it, through one of
    ``buffers`` (the slice as read, and as cast), at least one checksum block of the output. ``place(output)``:
    the region of it this piece is (None: every piece is whole, as in an export); ``tick(n)``: n bytes read;
    ``slice_bytes``: at most this many bytes per slice on either side of the cast (None: what a buffer holds)."""

    def __init__(self, reader: CheckpointReader, outputs: dict[str, Output],
                 place: Callable[[Output], tuple[Region, bool]] | None, tick: Callable[[int], None],
                 buffers: SliceBuffers, slice_bytes: int | None = None):
        self.reader, self.outputs, self.place, self.tick, self.buffers = reader, outputs, place, tick, buffers
        self.slice_bytes = slice_bytes

    def __getitem__(self, name: str) -> StreamedPiece:
        output = self.outputs[name]
        region = FlatRange(0, output.numel) if self.place is None else self.place(output)[0]
        if not isinstance(region, FlatRange):  # every placement convert makes is one run of the tensor
            raise AssertionError(f"{name!r}: output region {region} is not a flat range")
        return StreamedPiece(name, output.dtype, output.shape, region, functools.partial(self._slices, output, region))

    def stream(self, output: Output, region: FlatRange) -> Iterator[torch.Tensor]:
        """``region`` of ``output`` in as few slices as the buffers hold (``offline.dcp_output``'s chunks: one)."""
        return self._slices(output, region, itemsize(output.dtype), 0)

    def _slices(self, output: Output, region: FlatRange, block: int, first: int) -> Iterator[torch.Tensor]:
        region = FlatRange(region.start + first, region.stop)  # the elements before are kept (offline.resume)
        if not region.numel:
            return
        source, cast = output.source_dtype, output.dtype
        casts = cast != source
        per_element = itemsize(source) + (itemsize(cast) if casts else 0)
        block_elements = max(1, block // itemsize(cast))  # a block is a whole number of elements (format.index)
        count = max(1, (self.buffers.nbytes - ALIGN) // per_element // block_elements) * block_elements
        if self.slice_bytes is not None:
            count = min(count, max(1, self.slice_bytes // max(itemsize(source), itemsize(cast))))
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
