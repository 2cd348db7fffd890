"""A conversion written in shardckpt's own format, behind ``checkpoint.persist``'s seam (``ConvertedChunks``).

This process writes its share of the output ranks (all of them alone, or ``r % W == i`` as worker ``i`` of ``W``):
every data file of every one of its ranks is one job of one pool (``checkpoint.persist.write_files``), so the
ranks are written at once, each file streamed from the source a slice at a time (``offline.streams``) through
the slice buffers within ``memory_limit`` (``offline.memory``), its block checksums taken on the way
(``checkpoint.writer``) and made durable as it closes. A file a killed run of the same conversion wrote is kept
as far as its bytes check (``offline.rank_files``). The coordinator holds the output's data directory
exclusively from before any writing to the commit (gc leaves it alone, and a second run of the same conversion,
which has the same directory, fails at once), then checks each tensor's checksum, combined from the output's
chunks, against the source's (where the source records one and the values are not cast) and commits the
manifest last (``checkpoint.commit``). A failure keeps what was written, for a rerun; values that do not check
are removed, never kept.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

from shardckpt.checkpoint.commit import commit, data_dir
from shardckpt.checkpoint.gc import committed_dir
from shardckpt.checkpoint.persist import OutputWriter, write_files, writer_threads
from shardckpt.checkpoint.progress import Progress
from shardckpt.checkpoint.save_plan import SavePlan, WriteTask
from shardckpt.checkpoint.writer import RankResult, gathered_max, rank_result
from shardckpt.dist.group import Failure, Group, raise_failures
from shardckpt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardckpt.format.manifest import FileEntry, MANIFEST_NAME
from shardckpt.io import DirHold, Storage, lifecycle
from shardckpt.offline.convert_plan import ConversionPlan
from shardckpt.offline.memory import SliceBuffers, buffer_budget, read_reserve
from shardckpt.offline.rank_files import RankFiles
from shardckpt.offline.resume import journal_dir
from shardckpt.offline.streams import RUN_BYTES, Output, ReadOnDemand, largest_slice


def write_file(files: RankFiles, slot: int, data_path: str, index_path: str,
               tasks: list[WriteTask]) -> tuple[FileEntry, dict[str, int]]:
    """One data file of one output rank (kept, gone on with, or written)."""
    return files.write(slot, data_path, index_path, tasks)


class ConvertedChunks(OutputWriter):
    """A conversion's shardckpt output (see the module docstring); ``kept_ranks`` / ``kept_bytes`` after ``write``:
    this process's output ranks a killed run had finished, and the bytes of output it had written and that check."""

    def __init__(self, plan: ConversionPlan, storage: Storage, workers: Group,
                 progress: Callable[[int, int], None] | None):
        self.plan, self.storage, self.workers, self.progress = plan, storage, workers, progress
        self.chunks: SavePlan = plan.chunks
        self.hold: DirHold | None = None
        self.kept_ranks: tuple[int, ...] = ()
        self.kept_bytes = 0

    def begin(self) -> None:
        self.hold = lifecycle(self.storage).hold_dir(data_dir(self.plan.generation), exclusive=True)
        if committed_dir(self.storage) == data_dir(self.plan.generation):
            raise CheckpointExistsError(f"{self.storage.url(MANIFEST_NAME)}: the same conversion was committed here "
                                        "meanwhile")

    def write(self) -> dict[int, RankResult]:
        plan, files_per_rank = self.plan, self.chunks.files_per_rank
        mine = [r for r in self.chunks.tasks.writing_ranks() if r % self.workers.world_size == self.workers.rank]
        nbytes = sum(self.chunks.tasks.bytes(r) for r in mine)
        tick = Progress(nbytes, self.progress)
        tick.begin()
        budget = buffer_budget(plan.spec.memory_limit, "convert", read_reserve(plan.what.base, files_per_rank) +
                               gathered_max() * files_per_rank)  # (small chunks are gathered into larger writes)
        # (at least a run's bytes: small chunks are read in runs, offline.streams.FileRuns)
        buffers = SliceBuffers.within(budget, files_per_rank, max(largest_slice(plan.what.outputs), RUN_BYTES))
        by_name = {o.name: o for o in plan.what.outputs}
        ranks = {r: RankFiles(self.storage, self.chunks, ReadOnDemand(plan.what.reader, by_name, functools.partial(
            plan.place, rank=r), tick, buffers), buffers.take, tick, plan.version) for r in mine}
        jobs = [(r, slot) for r in mine for slot in range(files_per_rank)]
        written = write_files(jobs, functools.partial(self._write_file, ranks),
                              writer_threads(self.storage, files_per_rank, nbytes))
        self.kept_ranks = tuple(r for r in mine if ranks[r].whole)
        self.kept_bytes = sum(files.kept for files in ranks.values())
        return {r: rank_result([w for (rank, _), w in zip(jobs, written) if rank == r], plan.version) for r in mine}

    def _write_file(self, ranks: dict[int, RankFiles], job: tuple[int, int]) -> tuple[FileEntry, dict[str, int]]:
        rank, slot = job
        base = f"{data_dir(self.plan.generation)}/rank-{rank:05d}-{slot}"
        tasks = [t for t in self.chunks.tasks[rank] if t.slot == slot]
        return write_file(ranks[rank], slot, f"{base}.bin", f"{base}.index.json", tasks)

    def commit(self, shares: list) -> None:
        results = _in_rank_order(shares, self.plan.what.world)
        raise_failures([r for r in results if isinstance(r, Failure)])  # what was written stays, for a rerun
        what, generation = self.plan.what, self.plan.generation
        try:
            _check_against_source(results, what.outputs)
        except CorruptCheckpointError:
            _remove_uncommitted(self.storage, generation)  # else a rerun would keep what was wrong
            raise
        self.storage.remove_dir(journal_dir(generation))
        commit(self.storage, self.chunks, generation, results, what.encoded_tree, what.metadata,
               self.plan.spec.overwrite)

    def end(self) -> None:
        if self.hold is not None:
            self.hold.release()


def _in_rank_order(shares: list, world: int) -> list:
    """Every output rank's write result (None: nothing to write) from the processes' shares, or their failures."""
    failures = [share for share in shares if isinstance(share, Failure)]
    if failures:
        return failures
    results: list[Any] = [None] * world
    for share in shares:
        for r, result in share.items():
            results[r] = result
    return results


def _check_against_source(results: list, outputs: list[Output]) -> None:
    """Each output tensor's checksum (combined from its chunks' terms, as the commit does) is its source's, where
    the source records one and the values are not cast; else ``CorruptCheckpointError`` naming the tensor, before
    anything is committed."""
    for o in outputs:
        if o.source.crc32c is None or o.dtype != o.source.dtype:
            continue
        crc = functools.reduce(lambda acc, r: acc ^ (r.crc_terms.get(o.name, 0) if r is not None else 0), results, 0)
        if crc != o.source.crc32c and math.prod(o.source.shape):
            raise CorruptCheckpointError(f"{o.name}: the converted values' checksum {crc:08x} is not the source's "
                                         f"{o.source.crc32c:08x} (source tensor {o.source.name!r}); nothing was "
                                         "committed: run the conversion again")


def _remove_uncommitted(storage: Storage, generation: str) -> None:
    """Remove the data directory of ``generation`` unless a committed manifest names it: a conversion's generation
    is the same for every run of it, and another run of the same command may have committed it meanwhile."""
    try:
        committed = committed_dir(storage)
    except CheckpointError:  # a manifest that cannot be read now: keep everything
        return
    if committed != data_dir(generation):
        storage.remove_dir(data_dir(generation))
