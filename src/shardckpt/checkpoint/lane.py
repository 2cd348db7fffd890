"""The one load lane: ``open_checkpoint``, then ``read_planned``. ``load``, ``load_pieces`` and ``load_full``
(``checkpoint.load``) differ only in their ``Plan``; ``describe`` opens checkpoints the same way.

``open_checkpoint`` opens one committed generation for every rank of a group. shardckpt's own format: rank 0 reads the manifest
and sends it to every rank, so that all read the same generation (``NativeReader`` over it). Any other format
``formats.detect.open_reader`` reads: opened on every rank, a failure on any rank raised on all. The reader it
returns, a ``PinnedReader``, runs the caller's work on every rank (``run``): what any rank raises is raised on
every rank (``dist.group.attempt`` / ``raise_failures``: no rank waits for one that failed), and when a
concurrent overwrite committed a new generation meanwhile (it deletes the old generation's data files, which
a reader may not have opened yet), every rank pins the new one and the work starts over. ``read_planned`` is
that work for a load: a plan made on every rank and agreed (a refusal on any rank is raised on every rank before
anything is read), its requests read, then the plan finished.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from shardckpt.checkpoint.progress import ProgressCallback, read_reporting
from shardckpt.dist.group import Failure, Group, agreed, attempt, raise_failures, resolve_group
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import NativeReader
from shardckpt.io import DEFAULT_IO_THREADS, Storage, open_storage
from shardckpt.storage_options import Options

T = TypeVar("T")
ATTEMPTS = 5  # runs of the work: a concurrent overwrite can remove the data a reader is on; it then reads the new


class PinnedReader:
    """The reader of one committed generation of a checkpoint, held by every rank of ``group`` alike.

    It is a ``CheckpointReader`` (of the generation pinned now); ``run`` is how a load uses it."""

    def __init__(self, group: Group, storage: Storage, reader: CheckpointReader, io_threads: int, verify: bool):
        self.group, self.storage, self.reader = group, storage, reader
        self._io_threads, self._verify = io_threads, verify

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self.reader.tensors()

    def tree(self) -> Any:
        return self.reader.tree()

    def facts(self) -> Facts:
        return self.reader.facts()

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.reader.read(requests)

    def run(self, work: Callable[[CheckpointReader], T]) -> T:
        """``work(reader)`` on every rank (collective). If it raised on any rank, every rank raises that; unless a
        concurrent overwrite committed a new generation of shardckpt's format meanwhile: then every rank pins the
        new one and runs ``work`` again (``ATTEMPTS`` runs at most)."""
        runs = 0
        while True:
            runs += 1
            outcome = attempt(self.group.rank, lambda: work(self.reader))
            failures = self.group.all_gather(outcome if isinstance(outcome, Failure) else None)
            if not any(isinstance(f, Failure) for f in failures):
                return outcome
            if runs == ATTEMPTS or not self._repinned():
                raise_failures(failures)

    def check_stored(self, names: Iterable[str]) -> None:
        """Before memory is allocated for tensors ``names``: the stored bytes can hold them (shardckpt's format,
        whose reader checks its files as it reads; the other readers check their files as they open)."""
        if isinstance(self.reader, NativeReader):
            self.reader.check_stored(names)

    def _repinned(self) -> bool:
        """After a failure: whether a new generation was committed since this one was pinned (then it is pinned
        now, on every rank). A manifest unreadable now leaves the failure to be reported as it was."""
        if not isinstance(self.reader, NativeReader):
            return False
        data = _committed_manifest(self.group, self.storage, quiet=True)
        if data is None:
            return False
        try:
            manifest = parse_manifest(data, self.storage.url(MANIFEST_NAME))
        except CorruptCheckpointError:  # the same bytes on every rank: every rank takes this branch
            return False
        if manifest.generation == self.reader.manifest.generation:
            return False
        self.reader = NativeReader(self.storage, manifest, io_threads=self._io_threads, verify=self._verify)
        return True


def open_checkpoint(where: str | os.PathLike | Storage, *, process_group: Any = None,
                    storage_options: Options | None = None, io_threads: int = DEFAULT_IO_THREADS,
                    verify: bool = True) -> PinnedReader:
    """The checkpoint at ``where`` (a local path, an fsspec URL, or a ``Storage`` of its directory) opened for
    every rank of ``process_group`` (collective; ``dist.group.LOCAL``: this process alone), of any format
    ``formats.detect.open_reader`` reads. ``io_threads`` bounds concurrent reads; ``verify`` checks the checksums
    a format stores. Raises ``CheckpointNotFoundError`` where nothing is recognised, on every rank."""
    group = resolve_group(process_group)
    storage = open_storage(where, storage_options)
    data = _committed_manifest(group, storage)
    if data is None:
        other = _other_format(group, storage, io_threads, verify)
        if other is not None:
            return PinnedReader(group, storage, other, io_threads, verify)
        data = _committed_manifest(group, storage)  # a manifest committed since rank 0 looked
        if data is None:
            raise CheckpointNotFoundError(f"{storage.url(MANIFEST_NAME)}: no committed checkpoint here")
    manifest = parse_manifest(data, storage.url(MANIFEST_NAME))
    return PinnedReader(group, storage, NativeReader(storage, manifest, io_threads=io_threads, verify=verify),
                        io_threads, verify)


@dataclass(frozen=True)
class Plan:
    """What one rank reads through which reader, and ``finish()``, run once every request is read."""

    reader: CheckpointReader
    requests: list[ReadRequest]
    finish: Callable[[], Any]


def read_planned(pinned: PinnedReader, plan: Callable[[CheckpointReader], Plan],
                 progress: ProgressCallback | None = None) -> Any:
    """A load (collective over ``pinned.group``): ``plan(reader)`` on every rank, agreed; its requests read
    (``progress(done_bytes, total_bytes)`` told, starting over with the lane); ``finish()``'s result returned."""
    def work(reader: CheckpointReader) -> Any:
        planned = agreed(pinned.group, lambda: plan(reader))
        if planned.requests or progress is not None:
            read_reporting(planned.reader, planned.requests, progress)
        return planned.finish()

    return pinned.run(work)


def _committed_manifest(group: Group, storage: Storage, quiet: bool = False) -> bytes | None:
    """The committed manifest's bytes as rank 0 reads them, on every rank (None: none is committed). A failure to
    read it is raised on every rank, or with ``quiet`` taken as none."""
    mine = attempt(group.rank, lambda: storage.read_bytes(MANIFEST_NAME) if storage.exists(MANIFEST_NAME) else None) \
        if group.is_coordinator else None
    data = group.broadcast(mine)
    if isinstance(data, Failure):
        if quiet:
            return None
        raise_failures([data])
    return data


def _other_format(group: Group, storage: Storage, io_threads: int, verify: bool) -> CheckpointReader | None:
    """The reader of another format at ``storage``, opened on every rank (a failure on any: raised on all); None when
    some rank found shardckpt's own format there after all (committed since rank 0 looked: every rank reads it
    from rank 0's manifest then)."""
    outcome = attempt(group.rank, lambda: open_reader(storage, io_threads=io_threads, verify=verify))
    seen = group.all_gather(outcome if isinstance(outcome, Failure) else isinstance(outcome, NativeReader))
    raise_failures(seen)
    return None if any(s is True for s in seen) else outcome
