"""How the offline verbs move values: each output tensor (``Output``) streamed from the source a slice at a time
(``ReadOnDemand``, cast on the way if asked) through the slice buffers (``offline.memory.SliceBuffers``), as the
``StreamedPiece``s every output writer takes: shardckpt chunks (``convert``), DCP chunks and safetensors files.
A ``convert``'s small chunks are read in runs instead and written as ``HeldPiece``s (``FileRuns``)."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Iterator, Mapping

import torch

from shardckpt.checkpoint.writer import HeldPiece, StreamedPiece
from shardckpt.format.dtypes import itemsize
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.formats.flat import FlatRead, read_flat
from shardckpt.offline.memory import ALIGN, SliceBuffers
from shardckpt.regions import FlatRange, Region
from shardckpt.tensor_views import host_memory
from shardckpt.records import record

RUN_CHUNK_BYTES = 64 << 10  # a chunk at most this big is read with the small chunks after it (``FileRuns``)
RUN_BYTES = 4 << 20  # what a run reads at most: the slice buffers are at least this big when any chunk is small


@record
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
        self._regions: dict[str, FlatRange] = {}  # asked for several times per piece (``FileRuns``)

    def __getitem__(self, name: str) -> StreamedPiece:
        output = self.outputs[name]
        region = self.region(output)
        return StreamedPiece(name, output.dtype, output.shape, region, functools.partial(self._slices, output, region))

    def region(self, output: Output) -> FlatRange:
        """The region of ``output`` this piece is."""
        region = self._regions.get(output.name)
        if region is None:
            region = FlatRange(0, output.numel) if self.place is None else self.place(output)[0]
            if not isinstance(region, FlatRange):  # every placement convert makes is one run of the tensor
                raise AssertionError(f"{output.name!r}: output region {region} is not a flat range")
            self._regions[output.name] = region
        return region

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

    def __contains__(self, name: object) -> bool:  # (Mapping's would build the piece, or raise and catch KeyError)
        return name in self.outputs

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


class FileRuns(Mapping[str, "StreamedPiece | HeldPiece"]):
    """The pieces of one data file (``pieces``' own), its small chunks read in runs. ``chunks``: the names and
    regions (the save plan's) of the chunks to write from their start, in the file's order. Such a chunk of at most
    ``RUN_CHUNK_BYTES``, not cast, is read together with the small chunks after it, as many as one slice buffer
    holds, in one ``formats.flat.read_flat`` (which coalesces reads of neighbouring chunks and checks each chunk's
    CRC, with no tensor per chunk from shardckpt's own reader); then each is a ``HeldPiece`` of its bytes in that
    buffer. One read call per tensor cost a conversion of many small tensors most of its time. The buffer is held
    until a chunk outside the run is asked for, or ``close``: the file's writer asks for its chunks one at a time, in
    order, and writes a held piece before it asks for the next."""

    def __init__(self, pieces: ReadOnDemand, chunks: list[tuple[str, Region]]):
        self.pieces, self.names = pieces, [name for name, _ in chunks]
        self.small: dict[str, tuple[int, Output, FlatRange, int]] = {}  # position in names, output, region, bytes
        most = min(RUN_CHUNK_BYTES, pieces.buffers.nbytes)
        for i, (name, region) in enumerate(chunks):
            output = pieces.outputs[name]
            if output.dtype == output.source_dtype and type(region) is FlatRange:
                nbytes = region.numel * itemsize(output.dtype)
                if 0 < nbytes <= most:
                    self.small[name] = (i, output, region, nbytes)
        self.run: dict[str, memoryview] = {}
        self.held = contextlib.ExitStack()

    def __getitem__(self, name: str) -> StreamedPiece | HeldPiece:
        small = self.small.get(name)
        if small is None:
            output = self.pieces.outputs[name]  # (the piece ``pieces[name]`` is, its slices this file's)
            return StreamedPiece(name, output.dtype, output.shape, self.pieces.region(output),
                                 functools.partial(self._streamed, name))
        _, output, region, nbytes = small
        data = self._held(name)
        self.pieces.tick(nbytes)
        return HeldPiece(name, output.dtype, output.shape, region, data)

    def __contains__(self, name: object) -> bool:  # (Mapping's would build the piece, or raise and catch KeyError)
        return name in self.pieces.outputs

    def _streamed(self, name: str, block: int, first: int) -> Iterator[torch.Tensor]:
        self.close()  # the buffer goes back before the slices below take one
        yield from self.pieces[name].slices(block, first)

    def _held(self, name: str) -> memoryview:
        """The bytes of small chunk ``name``, read with the small chunks after it unless its run holds them."""
        data = self.run.pop(name, None)
        if data is None:
            self._read_run(name)
            data = self.run.pop(name)
        return data

    def _read_run(self, name: str) -> None:
        self.close()
        placed, size = {}, 0
        for later in self.names[self.small[name][0]:]:
            small = self.small.get(later)
            if small is None or later in placed:
                break
            at = -(-size // ALIGN) * ALIGN  # each view starts aligned for its dtype
            if at + small[3] > self.pieces.buffers.nbytes:
                break
            placed[later] = at
            size = at + small[3]
        buffer = self.held.enter_context(self.pieces.buffers.take(size))
        memory = host_memory(buffer)
        reads = []
        for later, at in placed.items():
            _, output, region, nbytes = self.small[later]
            reads.append(FlatRead(output.source.name, region, output.dtype, at))
            self.run[later] = memory[at:at + nbytes]
        read_flat(self.pieces.reader, reads, buffer)

    def close(self) -> None:
        """Give the run's buffer back (what is left of the run is read again if asked for)."""
        self.run.clear()
        self.held.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)
