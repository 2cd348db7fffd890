"""The data files of one output rank of ``convert``, written resumably: each file is kept (finished and checked),
taken up again after the prefix of it a killed run wrote and that checks, or written anew, with a journal as
it goes (``offline.resume``, ``offline.kept``). ``RankFiles.write`` writes one of them (``offline.chunk_output``)."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable

import torch

from shardckpt.checkpoint.save_plan import SavePlan, WriteTask
from shardckpt.checkpoint.writer import FileProgress, Followed, write_data_file
from shardckpt.offline.streams import FileRuns, ReadOnDemand
from shardckpt.offline.kept import kept_bytes, kept_chunk_terms, kept_progress
from shardckpt.offline.resume import (
    Claim, FileJournal, file_digest, finished_entry, go_on_writing, journal_dir, read_claim,
)
from shardckpt.checkpoint import writer as _writer  # its BLOCK_SIZE, read when used (tests shrink it)
from shardckpt.format.manifest import FileEntry
from shardckpt.io import LocalStorage, Storage

TakeBuffer = Callable[[int], "contextlib.AbstractContextManager[torch.Tensor]"]


class RankFiles:
    """One rank's files (``write``, called from the writer threads): after it, ``whole`` says whether every
    file was kept as a killed run finished it, ``kept`` how many logical bytes were kept in all. ``take(n)``: a
    slice buffer of at least ``n`` bytes (to read back what is kept); ``tick(n)``: ``n`` more bytes are done;
    ``version``: the output's format version (``format.manifest.version_for``)."""

    def __init__(self, storage: Storage, plan: SavePlan, pieces: ReadOnDemand, take: TakeBuffer,
                 tick: Callable[[int], None], version: int):
        self.storage, self.plan, self.pieces, self.take, self.tick = storage, plan, pieces, take, tick
        self.version = version  # the output's format version, which the indexes carry
        self.lock = threading.Lock()
        self.files_kept: list[bool] = []
        self.kept = 0

    @property
    def whole(self) -> bool:
        return bool(self.files_kept) and all(self.files_kept)

    def write(self, slot: int, data_path: str, index_path: str, tasks: list[WriteTask]) -> tuple[FileEntry, dict]:
        digest = file_digest(self.plan, data_path, tasks, self.version)
        journal_path = f"{journal_dir(self.plan.generation)}/{os.path.basename(data_path)}.json"
        claim = read_claim(self.storage, journal_path, digest, self.version)
        progress = self._checked(claim, data_path, tasks)
        if claim is not None and claim.finished and progress.current is None and len(progress.done) == len(tasks):
            entry = finished_entry(self.storage, data_path, index_path, progress, self.version)
            if entry is not None:
                self._kept(progress, whole=True)
                return entry, kept_chunk_terms(progress, self.plan)
        writer = go_on_writing(self.storage, data_path, progress.size) if progress.size else None
        if writer is None:
            progress = FileProgress()
            if isinstance(self.storage, LocalStorage):  # through the page cache: a journal's claims are in the file
                writer = self.storage.open_writer(data_path, direct=False)  # as soon as written, for a resume
        self._kept(progress, whole=False)
        journal = FileJournal(self.storage, journal_path, digest, self.version, isinstance(self.storage, LocalStorage))
        journal.begin(progress)
        # (the chunks to write from their start: a kept one is not read, a chunk a killed run began goes on streamed)
        fresh = [t for t in tasks if (t.name, t.chunk) not in progress.done and (t.name, t.chunk) != progress.current]
        runs = FileRuns(self.pieces, [(t.name, self.plan.tensors[t.name].regions[t.chunk]) for t in fresh])
        # (the journal's last word, the file finished, carries the index as written: not made again)
        followed = Followed(progress, writer, journal, indexed=functools.partial(journal.finish, progress))
        try:
            entry, terms = write_data_file(self.storage, data_path, index_path, tasks, runs, self.plan.compression,
                                           version=self.version, followed=followed)
        finally:
            runs.close()
        return entry, terms

    def _checked(self, claim: Claim | None, data_path: str, tasks: list[WriteTask]) -> FileProgress:
        """What a killed run's journal says it wrote of this file, as far as the bytes check."""
        if claim is None:
            return FileProgress()
        with self.take(_writer.BLOCK_SIZE) as buffer:
            return kept_progress(self.storage, data_path, claim, tasks, self.plan, buffer)

    def _kept(self, progress: FileProgress, whole: bool) -> None:
        n = kept_bytes(progress)
        with self.lock:
            self.files_kept.append(whole)
            self.kept += n
        self.tick(n)
