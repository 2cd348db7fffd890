"""Deciding, on rank 0, who writes which chunk (pure: no I/O, no collectives)."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from shardckpt.checkpoint.collect import LocalPiece, region_from_key, region_key
from shardckpt.errors import CheckpointError, UnsupportedValueError
from shardckpt.regions import Region, check_tiling, flat_bounds, full_region
from shardckpt.format.dtypes import DTYPES, dtype_name, itemsize
from shardckpt.format.chunks import Chunks, compact_chunks, is_whole, whole_chunk
from shardckpt.format.tensor_table import table_of
from shardckpt.format.codecs import Compression
from shardckpt.records import record


@record
class PieceInfo:
    """What a rank tells rank 0 about one tensor leaf."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    region: tuple  # region_key()
    replicated: bool
    owner: bool

    @classmethod
    def of(cls, piece: LocalPiece) -> PieceInfo:
        return cls(piece.name, dtype_name(piece.data.dtype, piece.name), piece.shape,
                   region_key(piece.region, piece.shape), piece.replicated, piece.owner)


@record
class WriteTask:
    """Rank must write its piece of ``name`` as chunk number ``chunk``, into its data file ``slot``."""

    name: str
    chunk: int
    slot: int = 0


@dataclass
class TensorPlan:
    dtype: str
    shape: tuple[int, ...]
    regions: list[Region] = field(default_factory=list)  # chunk i's region, ordered by first element
    writers: list[int] = field(default_factory=list)  # rank writing chunk i
    slot: int = 0  # which of each rank's data files holds this tensor's chunks

    def chunks(self, first_file: dict[int, int], memo: dict | None = None) -> Chunks:
        """``first_file[rank]``: the manifest position of that rank's first data file. ``memo``: chunks already made
        for this ``first_file``, which a plan whose tensors share tilings may look up (``Dim0TensorPlan``)."""
        return compact_chunks(self.regions, [first_file[r] + self.slot for r in self.writers], self.shape)


@dataclass
class SavePlan:
    generation: str  # names this save's data directory
    tensors: dict[str, TensorPlan]
    tasks: list[list[WriteTask]]  # per rank
    files_per_rank: int
    compression: Compression | None = None

    def table(self, first_file: dict[int, int], crcs: dict[str, int]) -> dict:
        """The manifest's tensor table (format v6) of these tensors, their checksums ``crcs`` (by name; 0 if absent):
        a tensor stored whole in one chunk (most of a save of many small tensors) finds its form by its dtype, shape
        and file, without a chunk description or manifest entry of its own (``TensorPlan.chunks`` for the others)."""
        keys: list[tuple] = []
        memo: dict = {}
        for tp in self.tensors.values():
            if is_whole(tp.regions, math.prod(tp.shape)):  # (one region: one chunk, one writer)
                keys.append((tp.dtype, tp.shape, first_file[tp.writers[0]] + tp.slot))
            else:
                keys.append((tp.dtype, tp.shape, tp.chunks(first_file, memo)))

        def form(key: tuple, i: int) -> dict:
            dtype, shape, placed = key
            chunks = whole_chunk(math.prod(shape), placed) if type(placed) is int else placed
            return {"dtype": dtype, "shape": list(shape), "chunks": chunks.to_json()}

        return table_of(list(self.tensors), [crcs.get(name, 0) for name in self.tensors], keys, form)

    @property
    def writing_ranks(self) -> list[int]:
        return [r for r, tasks in enumerate(self.tasks) if tasks]


def make_save_plan(infos: list[list[PieceInfo]], generation: str, files_per_rank: int = 2,
                   compression: Compression | None = None) -> SavePlan:
    """Check that ranks agree on every tensor and that shards tile it; assign each chunk a writer."""
    world = len(infos)
    tensors: dict[str, TensorPlan] = {}
    replicated: dict[str, TensorPlan] = {}
    pieces: dict[str, list[tuple[int, Region]]] = {}
    seen: dict[str, set] = {}
    first: dict[str, tuple[int, PieceInfo]] = {}  # by name: the first rank that holds it, and what it holds
    for rank, rank_infos in enumerate(infos):
        for info in rank_infos:
            known = first.get(info.name)
            if known is None:
                first[info.name] = (rank, info)
                tensors[info.name] = TensorPlan(info.dtype, info.shape)
            elif (info.dtype, info.shape, info.replicated) != (known[1].dtype, known[1].shape, known[1].replicated):
                raise _disagreement(info, rank, *known)
            plan = tensors[info.name]
            if info.replicated:
                replicated[info.name] = plan
            elif info.owner and info.region not in seen.setdefault(info.name, set()):
                # An identical region on another rank is a replica (e.g. HYBRID_SHARD): stored once.
                seen[info.name].add(info.region)
                pieces.setdefault(info.name, []).append((rank, region_from_key(info.region)))
    for name, owned in pieces.items():
        plan = tensors[name]
        _check_shards(name, [r for _, r in owned], plan.shape)
        for rank, region in sorted(owned, key=lambda o: flat_bounds(o[1], plan.shape)):
            if region.numel:
                plan.regions.append(region)
                plan.writers.append(rank)
    return plan_placed(tensors, set(replicated), world, generation, files_per_rank, compression)


def _disagreement(info: PieceInfo, rank: int, first_rank: int, first: PieceInfo) -> UnsupportedValueError:
    """Ranks hold one tensor name in different dtypes or shapes, or plain (replicated) on some and sharded on others."""
    def held(i: PieceInfo) -> str:
        return f"{i.dtype}{list(i.shape)}" + (" as a plain tensor" if i.replicated else " sharded")

    return UnsupportedValueError(f"cannot save {info.name!r}: rank {first_rank} holds {held(first)}, rank {rank} "
                                 f"{held(info)}; every rank must hold one tensor of the same dtype and shape, plain "
                                 "on every rank or sharded on every rank")


def plan_placed(tensors: dict[str, TensorPlan], replicated: set[str], world: int, generation: str,
                files_per_rank: int, compression: Compression | None = None) -> SavePlan:
    """The plan once every sharded tensor's chunks are placed (``regions`` tiling it, in order, and their
    ``writers``); the tensors named in ``replicated`` (no regions yet) are given one writer each. Callers
    that place chunks themselves (an offline ``convert``, whose placements are tilings by construction)
    call it directly, with one entry per tensor instead of one piece per rank and tensor."""
    load = [0] * world
    for plan in tensors.values():
        size = itemsize_of(plan.dtype)
        for rank, region in zip(plan.writers, plan.regions):
            load[rank] += region.numel * size
    # Replicated tensors are stored once; spread them over ranks, biggest first, so ranks write in parallel.
    sizes = {name: _nbytes(plan) for name, plan in tensors.items()}
    least = [(n, r) for r, n in enumerate(load)]  # a heap: the least loaded rank first (then the lowest)
    heapq.heapify(least)
    for name in sorted(replicated, key=lambda n: (-sizes[n], n)):
        plan = tensors[name]
        if math.prod(plan.shape):
            n, rank = least[0]
            plan.regions.append(full_region(plan.shape))
            plan.writers.append(rank)
            heapq.heapreplace(least, (n + sizes[name], rank))
    _assign_slots(tensors, files_per_rank, sizes)
    tasks: list[list[WriteTask]] = [[] for _ in range(world)]
    for name, plan in tensors.items():
        for chunk, rank in enumerate(plan.writers):
            tasks[rank].append(WriteTask(name, chunk, plan.slot))
    return SavePlan(generation, tensors, tasks, files_per_rank, compression)


def _assign_slots(tensors: dict[str, TensorPlan], files_per_rank: int, sizes: dict[str, int] | None = None) -> None:
    """Spread tensors over each rank's data files by total bytes (``sizes``, by name), biggest first. A tensor keeps
    one slot on every rank, so chunk i's file stays ``first + i * files_per_rank`` (compact in the manifest)."""
    if sizes is None:
        sizes = {name: _nbytes(plan) for name, plan in tensors.items()}
    least = [(0, k) for k in range(files_per_rank)]  # a heap, as for the ranks above
    for name in sorted(tensors, key=lambda n: (-sizes[n], n)):
        n, slot = least[0]
        tensors[name].slot = slot
        heapq.heapreplace(least, (n + sizes[name], slot))


def _check_shards(name: str, regions: list[Region], shape: tuple[int, ...]) -> None:
    try:
        check_tiling(regions, shape)
    except ValueError as e:
        raise CheckpointError(f"cannot save {name!r}: its shards across ranks do not tile it ({e}); each "
                              "element must be held by exactly one owning rank") from None


def itemsize_of(dtype: str) -> int:
    return itemsize(DTYPES[dtype])


def _nbytes(plan: TensorPlan) -> int:
    return math.prod(plan.shape) * itemsize_of(plan.dtype)
