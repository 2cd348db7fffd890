"""``shardckpt.save`` in three steps: ``stage`` (host buffers), ``plan`` (who writes what), ``persist``
(write, checksum, commit). ``save`` is the three run one after the other; each is public and callable on
its own, so that an async save is ``stage`` in the caller's thread and ``persist`` in the background:

    staged = stage(state_dict, copy=True)        # local: device-to-host; the caller may go on afterwards
    planned = plan(staged, path)                 # collective: rank 0 plans, every rank gets its tasks
    future = executor.submit(persist, staged, planned)   # collective: write, gather, rank 0 commits
    ...
    future.result()                              # raises on every rank if any rank failed

``stage`` (``checkpoint/stage.py``) is local and never raises: its error travels in the ``Staged`` and
``plan`` raises it on every rank. ``plan`` and ``persist`` are collectives over the same process group,
called on every rank in the same order; each raises on every rank when any rank fails (``dist.group``'s
``attempt``/``raise_failures``), after every rank has run the same collectives, so the group stays in
step. ``plan`` does no I/O beyond looking for an existing manifest; a plan that is never persisted leaves
nothing behind. Collectives from a background ``persist`` must not interleave with others on the same
group: give ``plan`` a group the training loop does not use (e.g. a gloo ``new_group``).

Commit protocol (``persist``, through ``checkpoint.persist``; ``checkpoint.commit``): each save writes a new
generation directory ``data-<generation>/``. Only after every rank's data and index files are durable does rank 0
write ``manifest.json`` in one atomic step (rename on local disk, a single PUT on object stores). The manifest is
the checkpoint: a crash before it leaves the previous checkpoint untouched; a failed persist removes its
generation's directory; an overwrite removes the previous generation's data only after the new manifest is
committed.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardckpt.checkpoint.agree import digest, encoded_holds_per_rank, fill_per_rank, refuse_difference
from shardckpt.checkpoint.commit import commit, data_dir
from shardckpt.checkpoint.persist import OutputWriter, persist as persist_output
from shardckpt.checkpoint.save_plan import PieceInfo, SavePlan, WriteTask, make_save_plan
from shardckpt.checkpoint.progress import ProgressCallback
from shardckpt.checkpoint.stage import Staged, stage
from shardckpt.checkpoint.writer import RankResult, write_rank_files
from shardckpt.dist.group import Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.errors import BadArgumentError, CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardckpt.format.codecs import Compression
from shardckpt.format.manifest import MANIFEST_NAME, check_tree, refuse_pool_dir, version_for
from shardckpt.format.tree import decode
from shardckpt.io import Storage, lifecycle, open_storage
from shardckpt.gc_pause import gc_paused
from shardckpt.options import takes
from shardckpt.storage_options import Options

__all__ = ["save", "stage", "plan", "persist", "Staged", "Planned", "DEFAULT_FILES_PER_RANK"]

DEFAULT_FILES_PER_RANK = 2  # data files each rank writes in parallel on save


@dataclass(frozen=True)
class SaveOptions:
    """``save``'s options besides the state dict, the path, the process group and the progress callback: the
    manifest's ``metadata`` (``stage``'s) and how ``plan`` writes (``overwrite``, ``files_per_rank``,
    ``storage_options``, ``compress``). ``save`` takes them as keywords."""

    overwrite: bool = False
    metadata: dict | None = None
    files_per_rank: int = DEFAULT_FILES_PER_RANK
    storage_options: Options | None = None
    compress: str | None = None
    incremental: bool | str = False
    incremental_unit: int = 4 << 20
    keep_last: int | None = None
    keep_every: int | None = None


@takes(SaveOptions, process_group=None, progress=None)
@gc_paused
def save(state_dict: dict, path: str | os.PathLike | Storage, *, process_group: Any = None,
         progress: ProgressCallback | None = None, **options: Any) -> None:
    """Save a (nested) state dict as a checkpoint at ``path`` (a local path, an fsspec URL, or a ``Storage``).

    Called collectively on every rank of ``process_group`` (default: the default group, or a world of one
    when torch.distributed is not initialised). Values may be plain tensors (full or replicated: stored
    once, by one rank), ``ShardedTensor``s, torch DTensors, plain JSON-able values, or ``PerRank`` values
    (one per rank). Every rank gives the same keys, nesting and plain values (checked by ``plan``).
    ``metadata`` is a JSON-able dict stored in the manifest. A committed checkpoint at ``path`` is replaced only with
    ``overwrite=True``; readers then see the complete old or the complete new checkpoint. Each rank writes
    ``files_per_rank`` data files in parallel (rank 0's value counts). ``compress="zstd"`` (or
    ``"zstd:LEVEL"``, -7..22; rank 0's value counts) stores each chunk as zstd frames, floating-point data
    split into byte planes first; a chunk that does not shrink is stored raw. Loads need no option.
    ``progress(done_bytes, total_bytes)`` is called, from the writer threads, as this rank writes its tensor
    bytes: ``(0, total)`` first, ``(total, total)`` last; if it raises, the save fails and commits nothing.
    ``incremental=True`` (or the checkpoint's parent directory) keeps the data in a chunk pool of the run directory,
    ``<parent>/shardckpt-pool/``, and writes only the units (``incremental_unit`` bytes, default 4 MiB) whose bytes
    differ from those of the run's latest pooled checkpoint, referencing the others (format v5; needs
    ``pip install 'shardckpt[incremental]'``). Every pooled checkpoint still loads, verifies and converts on its own.
    With ``incremental``, ``keep_last=N`` / ``keep_every=M`` remove, after the commit, the run's pooled steps that
    are neither among the N highest nor multiples of M, then the pool's data no step names any more.

    The same as ``persist(staged, plan(staged, path, ...))`` with ``staged = stage(state_dict, ...)``; rank 0's
    ``plan`` reuses the last save's assignment while every rank's pieces are the same (``plan(reuse=)``).
    """
    global _last_plan
    given = SaveOptions(**options)
    staged = stage(state_dict, process_group=process_group, metadata=given.metadata)
    group = resolve_group(process_group)
    mine = _last_plan if group.is_coordinator and _last_plan is not None and _last_plan.group == group else None
    planned = plan(staged, path, process_group=process_group, overwrite=given.overwrite,
                   files_per_rank=given.files_per_rank, storage_options=given.storage_options, compress=given.compress,
                   reuse=mine)
    if group.is_coordinator:
        _last_plan = planned
    persist_any(staged, planned, given, progress)


# Rank 0's last plan over its group: the next save of the same pieces keeps its assignment (``plan(reuse=)``, as
# ``async_save`` does). Only rank 0 holds one: the other ranks send their infos, which it compares with the plan's.
_last_plan: Planned | None = None


def persist_any(staged: Staged, planned: Planned, given: SaveOptions, progress: ProgressCallback | None,
                parent: str | None = None) -> Any:
    """``persist``, or with ``incremental`` its pooled form (``checkpoint.incremental``, which prefers ``parent``, a
    checkpoint of the run directory, as the one to reference; this rank's ``UnitDigests`` are returned; else None)."""
    options = incremental_options(given, parent)
    if options is not None:
        from shardckpt.checkpoint.incremental import persist_incremental  # (it imports this)
        return persist_incremental(staged, planned, options, given.incremental, progress)
    persist(staged, planned, progress=progress)
    return None


def incremental_options(given: SaveOptions, parent: str | None = None, path: Any = None) -> Any:
    """The ``IncrementalOptions`` of an incremental save (None for another); raises ``BadArgumentError`` for bad
    ones, which ``async_save`` checks in its call, not in the background (with ``path``, the pool's place too)."""
    if given.incremental and path is not None and given.incremental is not True:
        from shardckpt.checkpoint.pool import check_pool_argument  # (it imports this)
        check_pool_argument(given.incremental, open_storage(path, given.storage_options))
    if given.incremental:
        from shardckpt.checkpoint.incremental import IncrementalOptions  # (it imports this)
        return IncrementalOptions(given.incremental_unit, keep_last=given.keep_last, keep_every=given.keep_every,
                                  parent=parent)
    if given.keep_last is not None or given.keep_every is not None:
        raise BadArgumentError("keep_last and keep_every apply to incremental saves (incremental=True); remove "
                               "other checkpoints with shardckpt.rm")
    return None


@dataclass(frozen=True)
class Planned:
    """This rank's part of a save plan: where its files go and which chunks it writes.

    ``save_plan`` (the whole plan: every tensor's chunks and writers) and ``tree`` (the encoded tree to commit,
    every rank's ``PerRank`` values in it) are on rank 0 only, which commits."""

    group: Group
    storage: Storage
    generation: str
    tasks: list[WriteTask]
    files_per_rank: int
    compression: Compression | None
    save_plan: SavePlan | None
    overwrite: bool = False
    infos: list[PieceInfo] = field(default_factory=list)  # this rank's, as planned (for reuse)
    gathered: list | None = None  # every rank's infos (rank 0 only, for reuse)
    tree: Any = None
    version: int | None = None  # the format version of the indexes and manifest
    here: frozenset[int] | None = None  # the ranks whose files are where rank 0 commits (rank 0 only; tiers: a node's)

    @property
    def data_dir(self) -> str:
        return data_dir(self.generation)


def plan(staged: Staged, path: str | os.PathLike | Storage, *, process_group: Any = None, overwrite: bool = False,
         files_per_rank: int = DEFAULT_FILES_PER_RANK, storage_options: Options | None = None,
         compress: str | None = None, reuse: Planned | None = None) -> Planned:
    """Save step 2 of 3 (collective): rank 0 gathers every rank's piece infos and a digest of its tree, checks
    that the trees agree (``checkpoint.agree``; if not, every rank raises ``UnsupportedValueError`` naming the
    first key where a rank's differs from rank 0's) and the tensors, refuses an existing checkpoint unless
    ``overwrite``, and sends each rank its write tasks and the compression (rank 0's ``files_per_rank`` and
    ``compress`` count). Raises on every rank if any rank failed to stage or to open ``path``, or if
    planning failed. Writes nothing.

    ``path`` may differ between ranks (each rank's files go to its own ``Storage``; rank 0's gets the manifest):
    the tiers' node-local copies (``shardckpt.tiers``).

    ``reuse``: the ``Planned`` of an earlier save over the same group. A rank whose pieces are as they were
    then sends a marker instead of its infos; if every rank does (and the options are the same), rank 0
    keeps the old assignment under a new generation instead of planning again (async saves of a training
    state, whose shapes do not change)."""
    group = resolve_group(process_group)

    def local() -> _Report:
        if staged.rank != group.rank:
            raise ValueError(f"this Staged was staged as rank {staged.rank}, but this is rank {group.rank} of "
                             "the process group given to plan(); stage and plan with the same group")
        storage = open_storage(path, storage_options)
        refuse_pool_dir(storage.url(""))
        unchanged = reuse is not None and reuse.infos == staged.infos
        tree_digest = digest(staged.tree) if group.world_size > 1 else b""  # (compared with the other ranks' trees)
        return _Report(storage, storage.url(""), _UNCHANGED if unchanged else staged.infos, tree_digest,
                       staged.per_rank)

    report = staged.failure or attempt(group.rank, local)
    gathered = group.gather(report if isinstance(report, Failure) else dataclasses.replace(report, storage=None))
    whole = None
    if group.is_coordinator:
        whole = _plan_on_coordinator(report, gathered, staged.tree, reuse, overwrite, files_per_rank, compress)
    mine = group.scatter(_per_rank(whole, gathered) if group.is_coordinator else None)
    if isinstance(mine, _Differs):
        _refuse_differing_trees(group, staged, mine)
    raise_failures([mine, report])  # the same (the first failing rank's) on every rank
    generation, tasks, per_rank, compression, version = mine
    coordinator = group.is_coordinator
    here = frozenset(r for r, g in enumerate(gathered) if g.place == report.place) if coordinator else None
    return Planned(group, report.storage, generation, tasks, per_rank, compression,
                   whole[0] if coordinator else None, overwrite, staged.infos,
                   whole[2] if coordinator else None, whole[1] if coordinator else None, version, here)


@dataclass(frozen=True)
class _Report:
    """What a rank sends ``plan``'s rank 0: its piece infos (or ``_UNCHANGED``), the digest of its encoded tree
    and its ``PerRank`` values (its storage stays on the rank)."""

    storage: Storage | None
    place: str  # the storage's URL: ranks may write to different places (tiers), rank 0's gets the manifest
    infos: Any
    digest: bytes
    per_rank: dict[str, Any]


@dataclass(frozen=True)
class _Differs:
    """Rank 0's answer when the trees' digests differ: its tree, for the ranks whose digest differs from its own
    (None for the others); every rank then checks its own and all raise the first difference."""

    tree: Any


def _refuse_differing_trees(group: Group, staged: Staged, differs: _Differs) -> None:
    outcome = attempt(group.rank, lambda: differs.tree is not None and refuse_difference(differs.tree, staged.tree,
                                                                                        group.rank))
    raise_failures(group.all_gather(outcome if isinstance(outcome, Failure) else None))
    raise CheckpointError("cannot save: the ranks' state dicts differ, though no rank found where")


@dataclass(frozen=True)
class _Unchanged:
    """What a rank sends ``plan`` instead of its piece infos when they equal those of the reused plan."""


_UNCHANGED = _Unchanged()


def _with_reused(gathered: list, reuse: Planned | None, files_per_rank: int,
                 compress: str | None) -> tuple[list, SavePlan | None]:
    """Every rank's infos (the reused plan's for ranks that sent ``_UNCHANGED``), and the reused plan if all
    ranks are unchanged and the options are the same."""
    if reuse is None or reuse.gathered is None or len(reuse.gathered) != len(gathered):
        if any(isinstance(g, _Unchanged) for g in gathered):
            raise ValueError("plan(reuse=...) was given on some ranks only; give every rank its own Planned of "
                             "the same earlier save")
        return gathered, None
    infos = [reuse.gathered[r] if isinstance(g, _Unchanged) else g for r, g in enumerate(gathered)]
    same = infos == reuse.gathered and files_per_rank == reuse.files_per_rank and \
        Compression.parse(compress) == reuse.compression
    return infos, reuse.save_plan if same else None


def persist(staged: Staged, planned: Planned, *, progress: ProgressCallback | None = None) -> None:
    """Save step 3 of 3 (collective, on ``planned``'s group): every rank writes its data and index files
    from ``staged``'s host buffers (block checksums computed as they are written) and makes them durable;
    rank 0 gathers the results and commits the manifest last (``checkpoint.persist``, the pipeline ``convert`` and
    ``export`` write through too). Raises on every rank if any rank failed; the failed generation's files are then
    removed and a previous checkpoint stays as it was. Call it once per ``Planned``; it may run in a background
    thread (see the module docstring). ``progress``: as ``save``'s."""
    persist_output(_Saved(planned, staged, progress), planned.group)


class _Saved(OutputWriter):
    """A save's chunk files behind ``persist``'s seam. A writing rank holds its generation's directory until the
    commit is decided, so that another save's debris collection (checkpoint/gc.py) never takes it for an
    abandoned one."""

    def __init__(self, planned: Planned, staged: Staged, progress: ProgressCallback | None):
        self.planned, self.staged, self.progress, self.holds = planned, staged, progress, []

    def write(self) -> RankResult | None:
        return _write(self.planned, self.staged, self.holds, self.progress)

    def commit(self, shares: list) -> None:
        _commit(self.planned, shares, self.staged)

    def end(self) -> None:
        for hold in self.holds:
            hold.release()


def _plan_on_coordinator(report: _Report | Failure, gathered: list, tree: Any, reuse: Planned | None,
                         overwrite: bool, files_per_rank: int, compress: str | None) -> tuple | Failure | _Differs:
    """``(SavePlan, tree to commit, every rank's infos)``, or why not (a failure, or trees that differ)."""
    failures = [g for g in [report] + gathered if isinstance(g, Failure)]
    if failures:
        return failures[0]
    if any(g.digest != gathered[0].digest for g in gathered):
        return _Differs(tree)

    def make() -> tuple:
        infos, reused = _with_reused([g.infos for g in gathered], reuse, files_per_rank, compress)
        storage = report.storage
        if not overwrite and storage.exists(MANIFEST_NAME):
            raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a checkpoint already exists; pass "
                                        "overwrite=True to replace it")
        if not isinstance(files_per_rank, int) or not 1 <= files_per_rank <= 64:
            raise ValueError(f"files_per_rank must be an int in 1..64, got {files_per_rank!r}")
        generation = uuid.uuid4().hex[:16]
        if reused is not None:
            save_plan = dataclasses.replace(reused, generation=generation)
        else:
            save_plan = make_save_plan(infos, generation, files_per_rank, Compression.parse(compress))
        whole_tree = fill_per_rank(tree, [g.per_rank for g in gathered])
        if reused is None or reuse.tree != whole_tree:  # (the same tree over the same tensors was checked)
            _check_loadable(whole_tree, save_plan, storage)
        return save_plan, whole_tree, infos

    return attempt(0, make)


def _check_loadable(encoded_tree: Any, save_plan: SavePlan, storage: Storage) -> None:
    """The tree names every planned tensor once, under unique names (what a load checks), before anything is
    written: a guard, as the ranks' agreement already implies it."""
    where = storage.url(MANIFEST_NAME)
    try:
        check_tree(decode(encoded_tree, where, per_rank=True), save_plan.tensors, True, where)
    except CorruptCheckpointError as e:
        raise CheckpointError(f"cannot save: the checkpoint would not load ({e})") from None


def _per_rank(whole: tuple | Failure | _Differs, gathered: list) -> list:
    if isinstance(whole, Failure):
        return [whole] * len(gathered)
    if isinstance(whole, _Differs):
        return [_Differs(whole.tree if g.digest != gathered[0].digest else None) for g in gathered]
    save_plan, tree, _ = whole
    version = version_for(save_plan.compression is not None, encoded_holds_per_rank(tree), len(save_plan.tensors))
    return [(save_plan.generation, save_plan.tasks[r], save_plan.files_per_rank, save_plan.compression, version)
            for r in range(len(gathered))]


def _write(planned: Planned, staged: Staged, holds: list,
           progress: ProgressCallback | None = None) -> RankResult | None:
    if not planned.tasks:
        if progress is not None:
            progress(0, 0)  # nothing for this rank to write: done
        return None
    holds.append(lifecycle(planned.storage).hold_dir(planned.data_dir))
    base = f"{planned.data_dir}/rank-{planned.group.rank:05d}"
    return write_rank_files(planned.storage, base, planned.tasks, staged.pieces, planned.files_per_rank,
                            planned.compression, planned.version, progress=progress)


def _commit(planned: Planned, results: list, staged: Staged) -> None:
    commit(planned.storage, planned.save_plan, planned.generation, results, planned.tree, staged.metadata,
           planned.overwrite, here=planned.here)


