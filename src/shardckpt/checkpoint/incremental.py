"""``save(..., incremental=True)``: write only the chunks that changed since the run's last pooled checkpoint, and
reference the others in the pool (docs/design/incremental.md, 5.1; FORMAT.md, "Pooled checkpoints").

After ``stage`` and ``plan`` (unchanged), ``persist_incremental`` runs on every rank of the plan's group:

1. setup (rank 0, scattered): open or create the pool beside the checkpoint; pick the parent (the pooled
   checkpoint of the run directory with the highest step); hold, shared, every generation it names and this save's
   own (local ``flock``: a collector's exclusive lock excludes it), *then* check which of its files still exist and
   read their indexes; cut the plan into units (``checkpoint.units``) and give each unit the parent's row under the
   same (name, chunk) key, if any, as its candidate;
2. write (every rank, ``checkpoint.persist``'s seam): hash every unit with the pool's keyed BLAKE3-128; a unit whose
   candidate passes ``format.chunk_identity.reuse_decision`` is referenced, every other one is written (with its
   digest, the index's 9th value) into ``shardckpt-pool/data-<generation>/``;
3. commit (rank 0, ``checkpoint.pooled_commit``): a v5 manifest naming this save's new files and every referenced
   file, written last and atomically as for any save; then the holds are let go.

Correctness never depends on the parent chosen, nor on anything but the bytes: a reference is made only when the
digests of the stored row and of the bytes this save would write are equal (``format.content_hash``).
"""
from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardckpt.checkpoint.commit import data_dir
from shardckpt.checkpoint.memory_digests import WRITTEN, remembering
from shardckpt.checkpoint.persist import OutputWriter, persist, write_files
from shardckpt.checkpoint.pooled_commit import commit_pooled
from shardckpt.checkpoint.pool import (
    Candidate, check_pool_argument, hold_generations, latest_pool_checkpoint, open_pool, parent_table,
    referenced_files, release_all, run_storage,
)
from shardckpt.checkpoint.pool_gc import tidy_after_save
from shardckpt.checkpoint.pool_leases import SaveLease, read_markers
from shardckpt.checkpoint.progress import Progress, ProgressCallback
from shardckpt.checkpoint.retention import Retention
from shardckpt.checkpoint.save_plan import SavePlan, WriteTask
from shardckpt.checkpoint.units import DEFAULT_UNIT_BYTES, UnitPiece, unit_bytes_of, unit_piece, unit_plan
from shardckpt.checkpoint.writer import Followed, chunk_crc_term, write_data_file
from shardckpt.dist.group import Failure, attempt, raise_failures
from shardckpt.errors import BadArgumentError, CheckpointError
from shardckpt.format.checksum import xor_terms
from shardckpt.format.chunk_identity import REUSE, ChunkKey, NewChunk, reuse_decision
from shardckpt.format.content_hash import chunk_hash, chunk_key
from shardckpt.format.manifest import POOLED_VERSION, FileEntry
from shardckpt.format.pool import PoolInfo
from shardckpt.formats.native.pool import pool_storage
from shardckpt.io import LocalStorage, Storage
from shardckpt.regions import flat_bounds
from shardckpt.tensor_views import host_memory

log = logging.getLogger("shardckpt")

MAX_GENERATIONS = 64  # the most generations one pooled manifest references (consolidation beyond)
HASH_THREADS = 2  # units hashed at once per rank (BLAKE3 releases the GIL)
HASH_IN_THREADS = 256 << 10  # smaller units are hashed in the calling thread


@dataclass(frozen=True)
class IncrementalOptions:
    """How an incremental save cuts and references: ``unit_bytes`` per unit, ``max_generations`` referenced."""

    unit_bytes: int = DEFAULT_UNIT_BYTES
    max_generations: int = MAX_GENERATIONS
    keep_last: int | None = None
    keep_every: int | None = None
    parent: str | None = None  # the checkpoint of the run to reference, if committed in this pool (async_save's last)

    @property
    def retention(self) -> Retention | None:
        if self.keep_last is None and self.keep_every is None:
            return None
        return Retention(self.keep_last, self.keep_every)

    def __post_init__(self) -> None:
        self.retention  # noqa: B018 - checks keep_last / keep_every before anything is written
        if not isinstance(self.unit_bytes, int) or self.unit_bytes < 4096:
            raise BadArgumentError(f"incremental_unit must be an int of at least 4096 bytes, got {self.unit_bytes!r}")


@dataclass(frozen=True)
class UnitTask:
    task: WriteTask
    region: Any
    candidate: Candidate | None


@dataclass(frozen=True)
class _RankSetup:
    pool_id: str
    key: bytes
    generation: str
    tasks: list[UnitTask]


@dataclass
class _Whole:
    """Rank 0's side of the setup: the unit plan, the pool, the files references may name, the holds."""

    save_plan: SavePlan
    pool: Storage
    info: PoolInfo
    ref_files: dict[str, FileEntry]
    holds: list = field(default_factory=list)
    candidates: dict = field(default_factory=dict)  # (name, chunk) -> Candidate
    lease: SaveLease | None = None  # object stores


@dataclass(frozen=True)
class PooledShare:
    """One rank's write result: its new files (in slot order), where each chunk it wrote went (an index into
    ``files``), the chunks it referenced (-> the pool file), and each tensor's checksum terms."""

    files: list[FileEntry]
    placed: dict[tuple[str, int], int]
    refs: dict[tuple[str, int], str]
    crc_terms: dict[str, int]
    written_bytes: int = 0
    rows: dict = field(default_factory=dict)  # (name, chunk) -> (length, codec, crc32c, digest) of each chunk written


@dataclass(frozen=True)
class UnitDigests:
    """This rank's units of a committed save: by tensor name, each unit's element bounds and digest under ``key``."""

    key: bytes
    units: dict[str, dict[tuple[int, int], bytes]]


def persist_incremental(staged: Any, planned: Any, options: IncrementalOptions, incremental: Any,
                        progress: ProgressCallback | None = None) -> UnitDigests:
    """Save step 3 of 3 for ``incremental=``: see the module docstring. Collective over ``planned.group``. Returns
    this rank's units' digests (for ``async_save``'s next window)."""
    group = planned.group
    whole = attempt(0, lambda: _setup(planned, options, incremental)) if group.is_coordinator else None
    per_rank = None
    if group.is_coordinator:
        per_rank = [whole] * group.world_size if isinstance(whole, Failure) else _per_rank(whole, planned)
    mine = group.scatter(per_rank)
    try:
        raise_failures([mine])
        writer = _Incremental(planned, staged, mine, whole, progress)
        persist(writer, group)
    finally:
        if group.is_coordinator and isinstance(whole, _Whole):
            release_all(whole.holds)
    if group.is_coordinator:  # committed: retention and the pool's sweep, never failing the save
        tidy_after_save(planned.storage, whole.info.id, options.retention, writer.replaced)
    return UnitDigests(mine.key, writer.units)


def _setup(planned: Any, options: IncrementalOptions, incremental: Any) -> _Whole:
    storage = planned.storage
    check_pool_argument(incremental, storage)
    pool, info = open_pool(storage)
    chunk_key(info.secret)  # the hash is there (HashUnavailableError otherwise), before any rank writes
    whole = _Whole(_unit_plan(planned.save_plan, options.unit_bytes), pool, info, {})
    try:
        _hold_and_pick(whole, planned, options)
    except BaseException:
        release_all(whole.holds)
        raise
    return whole


_last_units: tuple | None = None  # (tensors, unit_bytes, the unit plan): rank 0's last, for a plan kept as it was


def _unit_plan(save_plan: SavePlan, unit_bytes: int) -> SavePlan:
    """``unit_plan``, kept for the next save over the same plan's tensors (rank 0 keeps its last plan while the
    pieces are the same: ``save``'s ``plan(reuse=)``; it is a function of the tensors' plans and ``unit_bytes``)."""
    global _last_units
    last = _last_units
    if last is not None and last[0] is save_plan.tensors and last[1] == unit_bytes:
        return dataclasses.replace(save_plan, tensors=last[2].tensors, tasks=last[2].tasks)
    units = unit_plan(save_plan, unit_bytes)
    _last_units = (save_plan.tensors, unit_bytes, units)
    return units


def _hold_and_pick(whole: _Whole, planned: Any, options: IncrementalOptions) -> None:
    """Hold this save's generation and its parent's (local: shared locks; object stores: the lease, then the
    collectors' markers read), *then* read which of the parent's chunks are there to reference."""
    storage, pool = planned.storage, whole.pool
    whole.holds.extend(hold_generations(pool, {planned.generation}))
    target = storage.root.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    # The step being overwritten may be the parent only when asked for (async_save's window compared against it):
    # its files are held like any parent's, and named by the new manifest.
    skip = "" if options.parent == target else target
    chosen = latest_pool_checkpoint(run_storage(storage), whole.info.id, skip=skip, prefer=options.parent)
    parent = chosen.manifest if chosen is not None else None
    doomed: frozenset[str] | None = frozenset()
    if not isinstance(pool, LocalStorage):  # no locks (pool_leases)
        whole.lease = SaveLease(pool, planned.generation, target, referenced_files([parent]) if parent else ())
        whole.holds.append(whole.lease)
        doomed = _doomed(pool)
    if parent is None or doomed is None:
        return
    whole.holds.extend(hold_generations(pool, {_generation(f.path) for f in parent.files}))
    table = parent_table(pool, parent)  # after the holds (the lease): files seen now stay until they end
    table = {k: c for k, c in table.items() if c.file.path not in doomed and c.file.index_path not in doomed}
    table = _consolidated(table, options.max_generations - 1)
    whole.ref_files = {c.file.path: c.file for c in table.values()}
    whole.candidates = table


def _doomed(pool: Storage) -> frozenset[str] | None:
    """The pool files a collector's sweep marker names (it may be deleting them: not referenced); None if a marker
    does not parse (then nothing is referenced: every chunk is written anew)."""
    try:
        return frozenset().union(*(m.files for m in read_markers(pool)))
    except CheckpointError as e:
        log.warning("%s; this save references nothing in the pool", e)
        return None


def _generation(path: str) -> str:
    return path.split("/", 1)[0].removeprefix("data-")


def _consolidated(table: dict, max_generations: int) -> dict:
    """The candidates less those of the generations a save takes the fewest bytes from, beyond ``max_generations``
    (``reachability.consolidate``: a load opens a bounded number of files)."""
    from shardckpt.checkpoint.reachability import consolidate

    by_generation: dict[str, int] = {}
    for c in table.values():
        g = _generation(c.file.path)
        by_generation[g] = by_generation.get(g, 0) + c.stored.length
    dropped = consolidate(by_generation, max(max_generations, 0))
    return {k: c for k, c in table.items() if _generation(c.file.path) not in dropped}


def _per_rank(whole: _Whole, planned: Any) -> list[_RankSetup]:
    key = chunk_key(whole.info.secret)
    table = whole.candidates
    out = []
    for tasks in whole.save_plan.tasks:
        units = [UnitTask(t, whole.save_plan.tensors[t.name].regions[t.chunk], table.get((t.name, t.chunk)))
                 for t in tasks]
        out.append(_RankSetup(whole.info.id, key, planned.generation, units))
    return out


class _Incremental(OutputWriter):
    def __init__(self, planned: Any, staged: Any, setup: _RankSetup, whole: _Whole | None,
                 progress: ProgressCallback | None):
        self.planned, self.staged, self.setup, self.whole, self.progress = planned, staged, setup, whole, progress
        self.holds: list = []
        self.units: dict = {}  # this rank's unit digests, once written
        self.replaced = False  # (rank 0) the commit replaced a committed checkpoint

    def write(self) -> PooledShare | None:
        share, self.units = _write_units(self.planned, self.staged, self.setup, self.holds, self.progress)
        return share

    def commit(self, shares: list) -> None:
        self.replaced = commit_pooled(self.planned, self.whole, shares, self.staged)

    def end(self) -> None:
        release_all(self.holds)


def _hashed(setup: _RankSetup, pieces: list[UnitPiece], memory: Any) -> list[bytes | None]:
    """Each unit's digest: remembered from an earlier save where the write tracker proves the caller's memory
    unwritten since (``checkpoint.memory_digests``); None for a unit it saw written (written again, its digest
    the writer's: hashing it first would only find it changed); else hashed now."""
    def one(piece: UnitPiece) -> bytes:  # read through the address: .numpy() would pin the caller's storage size
        return chunk_hash(setup.key, host_memory(unit_bytes_of(piece)))

    out = [memory.recall(p) for p in pieces]
    now = [i for i, digest in enumerate(out) if digest is None]
    big = [i for i in now if pieces[i].data.nbytes >= HASH_IN_THREADS]  # a thread's handoff costs more than a
    if len(big) > 1:  # small unit's hash
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="shardckpt-hash") as threads:
            for i, digest in zip(big, threads.map(one, [pieces[i] for i in big])):
                out[i] = digest
    for i in now:
        if out[i] is None:
            out[i] = one(pieces[i])
    return [None if digest is WRITTEN else digest for digest in out]


def _digests(setup: _RankSetup, staged: Any, pieces: list[UnitPiece], memory: Any) -> list[bytes | None]:
    """Each unit's digest under the pool key: hashed now from the staged bytes (or known, above), or, for a piece
    left unstaged (``checkpoint.window_hash``), the one taken in the blocked window (None if it was taken under
    another key)."""
    window = staged.prehashed
    if window is None:
        return _hashed(setup, pieces, memory)
    out: list[bytes | None] = [None] * len(pieces)
    now = [i for i, p in enumerate(pieces) if p.name not in window.digests]
    for i, digest in zip(now, _hashed(setup, [pieces[i] for i in now], memory)):
        out[i] = digest
    if window.key == setup.key:
        for i, piece in enumerate(pieces):
            if piece.name in window.digests:
                out[i] = _window_digest(window, piece)
    return out


def _window_digest(window: Any, piece: UnitPiece) -> bytes:
    digest = window.digests[piece.name].get(flat_bounds(piece.region, piece.shape))
    if digest is None:  # window_hash keeps only pieces that the previous save cut as this one does
        raise CheckpointError(f"tensor {piece.name!r} was hashed in async_save's window in other units than this "
                              "save writes; nothing was committed; the next save copies it")
    return digest


def _recopied(setup: _RankSetup, window: Any, piece: UnitPiece) -> tuple[UnitPiece, bytes]:
    """A unit left unstaged that cannot be referenced: a private copy of the caller's tensor, and its digest under
    the pool key, if the copy holds the value of the instant async_save returned (its window digest)."""
    data = piece.data.clone()
    copy = dataclasses.replace(piece, data=data)
    raw = host_memory(unit_bytes_of(copy))
    if chunk_hash(window.key, raw) != _window_digest(window, piece):
        raise CheckpointError(f"tensor {piece.name!r} changed after async_save returned, and its unchanged bytes "
                              "could not be referenced (a collector or another save replaced the previous step's "
                              "data); nothing was committed; the next save copies it")
    return copy, chunk_hash(setup.key, raw)


def _reusable(unit: UnitTask, setup: _RankSetup, piece: UnitPiece, digest: bytes | None) -> bool:
    if unit.candidate is None or digest is None:
        return False
    new = NewChunk(ChunkKey(unit.task.name, unit.task.chunk), setup.pool_id, piece.data.nbytes,
                   piece.data.dtype.itemsize, digest)
    return reuse_decision(unit.candidate.stored, new) == REUSE


def _write_units(planned: Any, staged: Any, setup: _RankSetup, holds: list,
                 progress: ProgressCallback | None) -> tuple[PooledShare | None, dict]:
    """This rank's units: each referenced if its candidate's digest is its own, else written into the pool. Also
    each unit's digest, by tensor name and bounds (what the next ``async_save``'s window compares)."""
    if not setup.tasks:
        if progress is not None:
            progress(0, 0)
        return None, {}
    pool = pool_storage(planned.storage)
    holds.extend(hold_generations(pool, {setup.generation}))
    pieces = [unit_piece(staged.pieces[u.task.name], u.region) for u in setup.tasks]
    refs, terms, to_write = {}, {}, []
    with remembering(setup.key, staged) as memory:
        digests = _digests(setup, staged, pieces, memory)
        for i, (unit, piece, digest) in enumerate(zip(setup.tasks, pieces, digests)):
            name = unit.task.name
            if _reusable(unit, setup, piece, digest):
                refs[(name, unit.task.chunk)] = unit.candidate.file.path
                term = chunk_crc_term(piece, piece.data.dtype.itemsize, unit.candidate.crc32c, unit_bytes_of(piece))
                terms[name] = terms.get(name, 0) ^ term
            else:
                if staged.prehashed is not None and name in staged.prehashed.digests:
                    piece, digest = _recopied(setup, staged.prehashed, piece)
                pieces[i] = dataclasses.replace(piece, digest=digest, hash_key=setup.key)
                to_write.append((unit.task, pieces[i]))
        files, placed, written_terms, written, records = _write_slots(pool, planned, setup, to_write, progress)
        stored = {key: r.digest for key, r in records.items()}  # the writers' digests of what they wrote
        _check_unmoved(to_write, stored, memory)
        digests = [stored[(u.task.name, u.task.chunk)] if d is None else d for u, d in zip(setup.tasks, digests)]
        memory.learn(pieces, digests)
    for name, term in written_terms.items():
        terms[name] = terms.get(name, 0) ^ term
    units: dict = {}
    for piece, digest in zip(pieces, digests):
        units.setdefault(piece.name, {})[flat_bounds(piece.region, piece.shape)] = digest
    rows = {key: (r.length, r.codec, r.crc32c, r.digest) for key, r in records.items()}
    return PooledShare(files, placed, refs, terms, written, rows), units


def _check_unmoved(written: list, digests: dict, memory: Any) -> None:
    """Each unit written holds the bytes hashed when the save chose to write it (or, for one it chose to write
    unhashed, bytes the write tracker saw unwritten since this save began). The writer hashes what it writes
    (the pool's digest is always of the stored bytes); a difference means the caller's tensor changed while a
    synchronous save wrote it in place: raise, and nothing is committed."""
    for task, piece in written:
        same = memory.unmoved(piece) if piece.digest is None else digests.get((task.name, task.chunk)) == piece.digest
        if not same:
            raise CheckpointError(f"tensor {task.name!r} changed while it was being saved (the bytes written are not "
                                  "those hashed when the save chose to write them: another thread or stream wrote "
                                  "to it); nothing was committed. Save a state that does not change meanwhile, or "
                                  "use async_save, which saves a copy")


def _write_slots(pool: Storage, planned: Any, setup: _RankSetup, to_write: list,
                 progress: ProgressCallback | None) -> tuple[list[FileEntry], dict, dict, int, dict]:
    """The units to write, into one pool file per slot that has any (``rank-<r>-<slot>.bin``), in parallel."""
    by_slot: dict[int, list] = {}
    for task, piece in to_write:
        by_slot.setdefault(task.slot, []).append((task, piece))
    slots = sorted(by_slot)
    total = sum(p.data.nbytes for _, p in to_write)
    tick = Progress(total, progress)
    tick.begin()
    base = f"{data_dir(setup.generation)}/rank-{planned.group.rank:05d}"
    records: dict = {}  # the writers' index rows of what they wrote

    def write(slot: int) -> tuple[FileEntry, dict[str, int]]:
        tasks = [t for t, _ in by_slot[slot]]
        pieces = {(t.name, t.chunk): p for t, p in by_slot[slot]}
        return write_data_file(pool, f"{base}-{slot}.bin", f"{base}-{slot}.index.json", tasks, pieces,
                               planned.compression, version=POOLED_VERSION, followed=Followed(tick=tick, records=records))

    written = write_files(slots, write, planned.files_per_rank)
    placed = {(t.name, t.chunk): k for k, slot in enumerate(slots) for t, _ in by_slot[slot]}
    return [entry for entry, _ in written], placed, xor_terms([terms for _, terms in written]), total, records


__all__ = ["IncrementalOptions", "persist_incremental", "PooledShare"]
