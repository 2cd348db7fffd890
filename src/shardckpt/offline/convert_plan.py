"""``convert``'s plan, pure: ``plan_conversion(reader, spec)`` decides everything a conversion writes from the source
reader's tree, tensor list and manifest (``offline.conversion``: what is made of it) and the spec, before anything
is read or written: the output's placement, the save plan of a shardckpt output, its format version, and the
generation that names its data directory (the same for every run of one conversion of a source with an identity,
so that a rerun finds what a killed run wrote: ``offline.resume``).

The save plan: who writes which chunk of the output, decided from the tensors' shapes alone.

A SHARDED output's tensor is ``world`` dim-0 chunks (``torch.chunk`` semantics), which follow from its shape and
``world`` by arithmetic: such a tensor is planned as a whole (``Dim0Chunks``: chunk i is rank i's, computed when
read), in O(1), and each rank's write tasks are built when that rank is written (``RankTasks``). Planning is then
O(tensors + ranks): a 405B-shaped model at 8192 ranks would be 25M chunk objects and as many tasks. Other
placements (a LOCAL output's flat shard ranges, replicas) are placed rank by rank. The plan is the one
``save_plan.plan_placed`` makes of the same placements, chunk by chunk (tests/convert/test_convert_plan.py).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from shardckpt.checkpoint.agree import encoded_holds_per_rank
from shardckpt.checkpoint.save_plan import SavePlan, TensorPlan, WriteTask, _assign_slots, itemsize_of
from shardckpt.format.chunks import Chunks, regular_chunks
from shardckpt.format.codecs import Compression
from shardckpt.format.dtypes import dtype_name
from shardckpt.format.manifest import version_for
from shardckpt.formats.api import CheckpointReader
from shardckpt.offline.conversion import Conversion, conversion
from shardckpt.offline.local_output import LocalAtWorldSize
from shardckpt.offline.resume import source_identity
from shardckpt.offline.spec import ConvertSpec
from shardckpt.offline.streams import Output
from shardckpt.regions import FlatRange, Region, dim0_chunk, full_region

Place = Callable[[Output, int], "tuple[Region, bool]"]


@dataclass(frozen=True)
class ConversionPlan:
    """What a conversion writes and where (``plan_conversion``)."""

    spec: ConvertSpec
    what: Conversion  # the output's type, world size, tree and tensors, and the reader they are made of
    shaping: dict  # the options that shape the output: with the source's identity, what names its generation
    generation: str  # names the output's data directory
    chunks: SavePlan | None  # a shardckpt output's chunks, per output rank (None: a DCP output)
    version: int  # the output's format version (``format.manifest.version_for``)

    def place(self, output: Output, rank: int) -> tuple[Region, bool]:
        """The region of ``output`` that output rank ``rank`` holds, and whether it is a replica."""
        return placement(output, rank, out_type=self.what.out_type, world=self.what.world, reader=self.what.reader)

    @property
    def tensor_bytes(self) -> int:
        """The output's tensor bytes, as stored (each tensor once)."""
        return sum(o.nbytes for o in self.what.outputs)

    def with_generation(self, generation: str) -> ConversionPlan:
        chunks = None if self.chunks is None else dataclasses.replace(self.chunks, generation=generation)
        return dataclasses.replace(self, generation=generation, chunks=chunks)


def plan_conversion(reader: CheckpointReader, spec: ConvertSpec) -> ConversionPlan:
    """Everything ``spec`` writes of the source ``reader`` (as opened, adapter applied), decided from what the reader
    holds already (its tree, tensor list and manifest) without reading a value or touching the destination."""
    what = conversion(reader, spec)
    shaping = _shaping(what, spec)
    identity = source_identity(what.base)
    generation = uuid.uuid4().hex[:16] if identity is None else \
        hashlib.sha256(json.dumps([identity, shaping], sort_keys=True, default=str).encode()).hexdigest()[:16]
    compression = Compression.parse(spec.compress)
    chunks = None
    if spec.format == "shardckpt":
        place = functools.partial(placement, out_type=what.out_type, world=what.world, reader=what.reader)
        tiled = functools.partial(dim0_tiled, out_type=what.out_type, reader=what.reader)
        chunks = plan_chunks(what.outputs, place, tiled, what.world, spec.files_per_rank, compression, generation)
    version = version_for(compression is not None, encoded_holds_per_rank(what.encoded_tree),
                          len(chunks.tensors) if chunks is not None else 0)  # as the commit counts them
    return ConversionPlan(spec, what, shaping, generation, chunks, version)


def _shaping(what: Conversion, spec: ConvertSpec) -> dict[str, Any]:
    """The options that shape the output, as every earlier version named them (a rerun after an upgrade resumes),
    but an adapter's: named by the options it resolved to (``adapters.reader.adapter_key``), since 2026-11-27."""
    names = None if spec.param_names is None else list(spec.param_names)
    common = {"world": what.world, "type": what.out_type, "dtype": spec.dtype, "only": list(spec.only),
              "exclude": list(spec.exclude), "param_names": names,
              "optim_key": None if what.key_type is None else what.key_type.value,
              **({"adapter": getattr(what.reader, "adapter_key", spec.adapter), "reverse": spec.reverse}
                 if spec.adapter is not None else {}),  # the options as resolved: a config file's contents
              **({"strip_prefix": spec.strip_prefix} if spec.strip_prefix else {})}
    if spec.format == "dcp":
        return {"format": "dcp", **common}
    return {**common, "files_per_rank": spec.files_per_rank, "compress": spec.compress}


def placement(output: Output, rank: int, *, out_type: str, world: int,
              reader: CheckpointReader) -> tuple[Region, bool]:
    """The region of ``output`` that virtual rank ``rank`` of ``world`` holds, and whether it is a replica."""
    shape = tuple(output.source.shape)
    flat = reader.piece_region(output.source.name, rank) if isinstance(reader, LocalAtWorldSize) else None
    if flat is not None:  # LOCAL output: a flat tensor's shard range
        return flat, False
    if out_type == "sharded" and shape:
        return dim0_chunk(shape, rank, world), False
    return full_region(shape), True


def dim0_tiled(output: Output, *, out_type: str, reader: CheckpointReader) -> bool:
    """Whether ``placement`` gives ``output`` as dim-0 chunks (then ``Dim0Chunks`` plans it without placing)."""
    return out_type == "sharded" and bool(output.source.shape) and not isinstance(reader, LocalAtWorldSize)


class Dim0Chunks(Sequence[Region]):
    """The non-empty dim-0 chunks of ``shape`` over ``world`` ranks, computed when read; chunk i is rank i's."""

    __slots__ = ("size", "numel", "_len")

    def __init__(self, shape: Sequence[int], world: int):
        self.size = -(-shape[0] // world) * math.prod(shape[1:])  # whole rows per chunk, as elements
        self.numel = math.prod(shape)
        self._len = -(-self.numel // self.size) if self.numel else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):  # type: ignore[override]
        if type(i) is not int or not 0 <= i < self._len:  # (a chunk's own index, the common case, read directly)
            if isinstance(i, slice):
                return [self[j] for j in range(self._len)[i]]
            i = range(self._len)[i]
        start = i * self.size
        return FlatRange(start, min(start + self.size, self.numel))

    def last_numel(self) -> int:
        return self.numel - (self._len - 1) * self.size


@dataclass
class Dim0TensorPlan(TensorPlan):
    """A tensor stored as ``Dim0Chunks`` (at least one), written by ranks ``range(len(regions))``."""

    def chunks(self, first_file: dict[int, int], memo: dict | None = None) -> Chunks:
        regions, slot = self.regions, self.slot  # (the first chunk's size without making its region: a commit's table)
        # (the chunks follow from the size, the count and the slot: tensors of one tiling share them, in ``memo``)
        key = (min(regions.size, regions.numel), len(self.writers), slot)
        chunks = memo.get(key) if memo is not None else None
        if chunks is None:
            chunks = regular_chunks(key[0], [first_file[r] + slot for r in self.writers])
            if memo is not None:
                memo[key] = chunks
        return chunks


class RankTasks(Sequence[list]):
    """Each rank's write tasks, in the tensors' order (chunks in order within one), built when a rank's are asked."""

    def __init__(self, tensors: dict[str, TensorPlan], rank_bytes: list[int]):
        self._bytes = rank_bytes
        self._order = []  # (name, slot, writers): a range for dim-0 tilings, else {rank: [chunk, ...]}
        for name, plan in tensors.items():
            writers = plan.writers
            if not isinstance(plan, Dim0TensorPlan):
                writers = {}
                for chunk, rank in enumerate(plan.writers):
                    writers.setdefault(rank, []).append(chunk)
            self._order.append((name, plan.slot, writers))

    def __len__(self) -> int:
        return len(self._bytes)

    def __getitem__(self, rank):  # type: ignore[override]
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        rank = range(len(self))[rank]
        tasks = []
        for name, slot, writers in self._order:
            if isinstance(writers, range):
                if rank < len(writers):
                    tasks.append(WriteTask(name, rank, slot))
            else:
                tasks.extend(WriteTask(name, chunk, slot) for chunk in writers.get(rank, ()))
        return tasks

    def __iter__(self) -> Iterator[list]:
        return (self[r] for r in range(len(self)))

    def bytes(self, rank: int) -> int:
        """The stored bytes of ``rank``'s chunks (uncompressed)."""
        return self._bytes[rank]

    def writing_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self._bytes) if n]


def plan_chunks(outputs: list[Output], place: Place, tiled: Callable[[Output], bool], world: int,
                files_per_rank: int, compression: Compression | None, generation: str) -> SavePlan:
    """The save plan, one entry per tensor: ``tiled`` ones as ``Dim0Chunks``, the others' chunks the placements of
    ranks 0..world-1 (tilings in order by construction: a flat layout's shard ranges), a replica written once."""
    tensors: dict[str, TensorPlan] = {}
    replicated = []
    for o in outputs:
        dtype, shape = dtype_name(o.dtype, o.name), tuple(o.source.shape)
        if tiled(o):
            chunks = Dim0Chunks(shape, world)
            tensors[o.name] = Dim0TensorPlan(dtype, shape, chunks, range(len(chunks))) if len(chunks) else \
                TensorPlan(dtype, shape)
            continue
        plan = tensors[o.name] = TensorPlan(dtype, shape)
        for rank in range(world):
            region, is_replica = place(o, rank)
            if is_replica:
                replicated.append(o.name)
                break
            if region.numel:
                plan.regions.append(region)
                plan.writers.append(rank)
    load = _rank_bytes(tensors, world)
    _place_replicas(tensors, replicated, load)
    _assign_slots(tensors, files_per_rank)
    return SavePlan(generation, tensors, RankTasks(tensors, load), files_per_rank, compression)  # type: ignore[arg-type]


def _rank_bytes(tensors: dict[str, TensorPlan], world: int) -> list[int]:
    """Bytes each rank writes of the placed chunks: a dim-0 tiling adds its chunk size to ranks 0..n-2 (as a
    difference at both ends, summed once at the end) and the last chunk's to rank n-1."""
    step, load = [0] * (world + 1), [0] * world
    for plan in tensors.values():
        size = itemsize_of(plan.dtype)
        if isinstance(plan, Dim0TensorPlan):
            n = len(plan.regions)
            step[0] += plan.regions.size * size
            step[n - 1] -= plan.regions.size * size
            load[n - 1] += plan.regions.last_numel() * size
        else:
            for rank, region in zip(plan.writers, plan.regions):
                load[rank] += region.numel * size
    running = 0
    for rank in range(world):
        running += step[rank]
        load[rank] += running
    return load


def _place_replicas(tensors: dict[str, TensorPlan], replicated: list[str], load: list[int]) -> None:
    """Each replicated tensor (stored once) to the rank with the fewest bytes so far (the lowest on a tie), biggest
    first, as ``plan_placed`` does, with a heap of (bytes, rank) instead of a scan of every rank per tensor."""
    def nbytes(name: str) -> int:
        return math.prod(tensors[name].shape) * itemsize_of(tensors[name].dtype)

    heap = [(n, r) for r, n in enumerate(load)]
    heapq.heapify(heap)
    for name in sorted(replicated, key=lambda n: (-nbytes(n), n)):
        plan = tensors[name]
        if nbytes(name):
            held, rank = heapq.heappop(heap)
            plan.regions.append(full_region(plan.shape))
            plan.writers.append(rank)
            load[rank] = held + nbytes(name)
            heapq.heappush(heap, (load[rank], rank))
