"""What lets ``convert`` and ``export`` resume after a kill: a source's identity, a deterministic name for a
conversion's output, and the journal of each data file that says how far a killed run had written it.

A conversion's data directory is named by a hash of the source's identity and every option that shapes the
output (``offline.convert_plan``; ``unused_generation`` unless committed there already), so a rerun of the same
command finds what the killed run wrote. While
``convert`` writes a data file it keeps a journal beside it (``resume/<file>.json`` in the data directory,
replaced whole, a few times per file): a digest of what the plan puts in that file, the records of its
finished chunks and the block CRCs of the chunk in progress, and at the end that the file and its index are
finished. A rerun (``kept_file``) takes from a journal whose digest is this plan's the longest prefix of the
file whose every block is there and matches its CRC (``offline.kept``: read back, frames decoded): a finished
file is kept whole, with its index; a partial one is written on from the end of that prefix (local disk;
object stores, where an object cannot be written on, keep finished files only). A flipped byte, a torn or
truncated block, a journal or index that does not match: the file is written again from there. The journals
are removed before the commit.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass

from shardckpt.checkpoint.gc import committed_dir
from shardckpt.checkpoint.commit import data_dir
from shardckpt.checkpoint.save_plan import SavePlan, WriteTask
from shardckpt.checkpoint.writer import ALIGN, FileProgress
from shardckpt.errors import CheckpointError
from shardckpt.format.checksum import crc32c
from shardckpt.checkpoint import writer as _writer  # its BLOCK_SIZE, read when used (tests shrink it)
from shardckpt.format.index import ChunkRecord, index_to_bytes, parse_index
from shardckpt.format.manifest import FileEntry
from shardckpt.formats.api import CheckpointReader
from shardckpt.io import FileWriter, LocalStorage, Storage, lifecycle
from shardckpt.regions import FlatRange, Region

JOURNAL_FORMAT = "shardckpt-convert-journal"
JOURNAL_BYTES = 16 << 20  # a journal is replaced after this many bytes written, or 1/32 of the file so far if more


def source_identity(reader: CheckpointReader) -> str | None:
    """What changes whenever the source's values may: a shardckpt checkpoint's generation (new at every save
    and convert). None for other formats: nothing in their files changes with every write, so their
    conversions and exports are never resumed, always redone."""
    return reader.facts().identity


def content_identity(reader: CheckpointReader) -> str | None:
    """What the source holds, whatever save wrote it: a digest of a shardckpt checkpoint's tensors (name, dtype,
    shape and whole-tensor CRC32C, which sharding does not change), its tree and its metadata; not its
    generation, paths or world size. Two saves of equal state have the same; a changed tensor changes it
    unless its CRC32C collides (the odds ``kept`` takes for a resumed block too). None for other formats."""
    facts = reader.facts()
    if facts.identity is None:
        return None
    tensors = sorted((name, str(t.dtype), list(t.shape), t.crc32c) for name, t in reader.tensors().items())
    key = json.dumps([tensors, reader.tree(), dict(facts.metadata)], sort_keys=True, default=repr)
    return "shardckpt-content:" + hashlib.sha256(key.encode()).hexdigest()


def unused_generation(storage: Storage, generation: str) -> str:
    """``generation`` (``offline.convert_plan``: a hash of the source's identity and the options that shape the
    output), or a random one when the committed checkpoint at ``storage`` already has it (its files must not be
    written over) or cannot be read (take no chance with its files)."""
    try:
        taken = committed_dir(storage) == data_dir(generation)
    except CheckpointError:
        taken = True
    return uuid.uuid4().hex[:16] if taken else generation


def journal_dir(generation: str) -> str:
    return f"{data_dir(generation)}/resume"


def file_digest(plan: SavePlan, data_path: str, tasks: list[WriteTask], version: int) -> str:
    """What the plan puts in one data file, and how: the chunks, in order, their tensors' dtypes, shapes and
    regions, the codec, the block size, the format version; a journal of another plan is never taken."""
    tensors = plan.tensors
    doc = [plan.generation, data_path, version, _writer.BLOCK_SIZE, ALIGN,
           repr(plan.compression),
           [[t.name, t.chunk, tp.dtype, list(tp.shape), _region_text(tp.regions[t.chunk])]
            for t in tasks for tp in (tensors[t.name],)]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def _region_text(region: Region) -> str:
    """``repr(region)``, a flat range's made directly (a dataclass's repr costs 2 us: 100k chunks, 0.2 s)."""
    return f"FlatRange(start={region.start}, stop={region.stop})" if type(region) is FlatRange else repr(region)


class FileJournal:
    """The journal of one data file as it is written (``checkpoint.writer.Journal``): replaced after every
    ``JOURNAL_BYTES`` (or, when that is more, 1/32 of the file so far) written where a partial file can be gone on with (``partial``:
    local disk); ``finish`` records the file finished. Not synced: nothing is kept on its word alone (a rerun
    reads every kept byte back), and a journal synced every few MiB would wait for the data file's writeback."""

    def __init__(self, storage: Storage, path: str, digest: str, version: int, partial: bool):
        self.storage, self.path, self.digest, self.version, self.partial = storage, path, digest, version, partial
        self.written = -1

    def __call__(self, progress: FileProgress) -> None:
        if self.partial and progress.size - self.written >= max(JOURNAL_BYTES, progress.size // 32):
            self._put(progress, finished=False)

    def begin(self, progress: FileProgress) -> None:
        """Record, before anything is written, that this plan owns the file (and what of it is kept)."""
        lifecycle(self.storage).hold_dir(self.path.rsplit("/", 1)[0]).release()  # made where the store has directories
        self._put(progress, finished=False)

    def finish(self, progress: FileProgress, index: bytes) -> None:
        """Record the file finished (its data and index durable; ``index``: the index's bytes, its records
        ``progress.done``'s)."""
        self._put(progress, finished=True, index=index)

    def _put(self, progress: FileProgress, finished: bool, index: bytes | None = None) -> None:
        current = None if progress.current is None else \
            [*progress.current, progress.offset, list(progress.blocks), list(progress.frames)]
        head = json.dumps({"format": JOURNAL_FORMAT, "digest": self.digest, "finished": finished,
                           "size": progress.size, "current": current}, separators=(",", ":")).encode()
        # The index's own JSON spliced in as the last field: not parsed back and dumped again (a file of 10k chunks)
        if index is None:
            index = index_to_bytes(progress.done, self.version, _writer.BLOCK_SIZE)
        data = head[:-1] + b',"index":' + index + b"}"
        if isinstance(self.storage, LocalStorage):  # whole or absent for readers (a rename), and not synced
            url = self.storage.url(self.path)
            try:
                with open(f"{url}.tmp", "wb") as f:
                    f.write(data)
                os.replace(f"{url}.tmp", url)
            except FileNotFoundError:  # its directory removed: a run of the same conversion committed (no locks)
                return
        else:
            self.storage.put_atomic(self.path, data)
        self.written = progress.size


@dataclass(frozen=True)
class Claim:
    """What a journal says was written of a data file: its finished chunks and the chunk in progress (as a record
    of its blocks so far), and whether the file and its index were finished."""

    done: dict[tuple[str, int], ChunkRecord]
    current: tuple[tuple[str, int], ChunkRecord] | None
    finished: bool


def read_claim(storage: Storage, path: str, digest: str, version: int) -> Claim | None:
    """The journal at ``path`` if it is one of this plan's (``digest``) and well formed; else None."""
    try:
        doc = json.loads(storage.read_bytes(path))
        if not (isinstance(doc, dict) and doc.get("format") == JOURNAL_FORMAT and doc.get("digest") == digest):
            return None
        done = parse_index(json.dumps(doc["index"]).encode(), version, 1 << 62, path)
        current = doc["current"]
        if current is not None:
            name, chunk, offset, blocks, frames = current
            if not (isinstance(name, str) and all(type(v) is int and v >= 0 for v in (chunk, offset))
                    and isinstance(blocks, list) and all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in blocks)
                    and isinstance(frames, list) and all(type(x) is int and x >= 0 for x in frames)):
                return None
            current = ((name, chunk), ChunkRecord(offset, len(blocks) * _writer.BLOCK_SIZE, 0, "", _writer.BLOCK_SIZE,
                                                  tuple(blocks), tuple(frames)))
        return Claim(done, current, doc["finished"] is True)
    except (CheckpointError, ValueError, KeyError, TypeError):
        return None


def go_on_writing(storage: Storage, path: str, size: int) -> FileWriter | None:
    """A writer of the data file at ``path`` that keeps its first ``size`` bytes and writes after them (what
    follows is cut off); None where files cannot be written on (object stores) or it is gone."""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        return storage.open_writer(path, keep=size)
    except OSError:
        return None


def finished_entry(storage: Storage, data_path: str, index_path: str, progress: FileProgress,
                   version: int) -> FileEntry | None:
    """The file's manifest entry, if its index lists exactly ``progress``'s chunks (all of them checked) and the
    data file ends where they do; None if anything differs (the file is then finished again)."""
    try:
        size = storage.file_size(data_path)
        index = storage.read_bytes(index_path)
        records = parse_index(index, version, size, storage.url(index_path))
    except CheckpointError:
        return None
    if progress.current is not None or records != progress.done or list(records) != list(progress.done) or \
            size != progress.size:
        return None
    return FileEntry(data_path, size, index_path, len(index), crc32c(index))
