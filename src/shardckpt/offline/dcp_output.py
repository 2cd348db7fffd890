"""``convert --format dcp``: the conversion ``offline.conversion`` decided, written as a torch DCP directory
(``.metadata`` plus ``__R_K.distcp`` files, one per output rank) that ``torch.distributed.checkpoint.load``,
``format_utils.dcp_to_torch_save`` and torchtitan read. DCP stores one value per key: per-rank values (format v4)
are refused, naming their keys (``--exclude`` them).

The same plan and streams as the shardckpt output (``offline.convert_plan``'s placement, ``offline.streams``), and
the same pipeline (``checkpoint.persist``: ``DcpOutput`` is the format's writer behind its seam): each
DCP chunk (``offline.dcp_layout``: a box of at most one slice buffer) is read from the source (cast if asked)
into the buffer and ``torch.save``d from there into its rank's file, as DCP's ``FileSystemWriter`` stores it,
so memory stays within ``memory_limit``. Before the commit, each tensor's checksum combined from its chunks
must be the source's where the source records one and the values are not cast.

Resumable: while a conversion writes, ``.shardckpt-dcp/<generation>/`` holds (exclusively) one journal per
finished rank file: what the plan put in it and its CRC32C. A rerun of the same conversion (the same
generation, ``offline.resume``: shardckpt sources) keeps a rank file whose journal is this plan's and whose
bytes, read back, match; it writes the others again.

Committed atomically: ``.metadata`` is written last (``put_atomic``), and nothing else makes the directory a
DCP checkpoint. Over a committed DCP checkpoint (``overwrite``), the new files take a file index (the ``K`` of
``__R_K``) its ``.metadata`` does not name, so the old checkpoint reads whole until the new ``.metadata``
replaces it; its files are removed after that.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardckpt.checkpoint.agree import per_rank_names
from shardckpt.checkpoint.persist import OutputWriter, write_files
from shardckpt.checkpoint.progress import Progress
from shardckpt.dist.group import raise_failures
from shardckpt.errors import (
    CheckpointError, CheckpointExistsError, CorruptCheckpointError, UnsupportedValueError,
)
from shardckpt.format.checksum import crc32c, runs_crc_term
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.tree import TensorRef, decode
from shardckpt.formats.dcp.metadata import METADATA_NAME, parse_metadata
from shardckpt.io import DirHold, Storage
from shardckpt.offline.convert_plan import ConversionPlan
from shardckpt.offline.dcp_layout import DcpBytesItem, DcpTensorItem, flat_keys, rank_tensor_items
from shardckpt.offline.memory import ALIGN, SliceBuffers, buffer_budget, read_reserve
from shardckpt.offline.safetensors_files import remove
from shardckpt.offline.streams import Output, ReadOnDemand, largest_slice

RESUME_DIR = ".shardckpt-dcp"
DCP_VERSION = "1.0.0"  # torch 2.13's CURRENT_DCP_VERSION
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


@dataclass(frozen=True)
class Stored:
    """Where one item went: its file, offset and length, and (tensors) the CRC32C of its elements' bytes."""

    key: str
    offsets: tuple[int, ...] | None  # None: a bytes item
    path: str
    offset: int
    length: int
    sizes: tuple[int, ...] = ()
    crc: int = 0


class _Counting:
    """What ``torch.save`` writes to: a storage writer that counts the bytes and takes their CRC32C on the way."""

    def __init__(self, writer):
        self.writer, self.size, self.crc = writer, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.writer.write(view)
        self.crc = crc32c(view, self.crc)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass


class DcpOutput(OutputWriter):
    """A conversion written as a torch DCP checkpoint, behind ``checkpoint.persist``'s seam (one process): its rank
    files kept or written in turn through one slice buffer, ``.metadata`` committed last. ``kept_ranks`` /
    ``kept_bytes``: the rank files a killed run of the same conversion had finished, and their bytes."""

    def __init__(self, plan: ConversionPlan, storage: Storage, progress: Callable[[int, int], None] | None):
        self.plan, self.storage, self.progress = plan, storage, progress
        _refuse_per_rank(plan.what.encoded_tree)  # before the tree is decoded, which would call them corrupt
        self.keyed = flat_keys(decode(plan.what.encoded_tree, "the conversion's tree"))
        by_name = {o.name: o for o in plan.what.outputs}
        self.tensors = [(key, by_name[leaf.name]) for key, _, leaf in self.keyed if isinstance(leaf, TensorRef)]
        self.journals = f"{RESUME_DIR}/{plan.generation}"
        self.hold: DirHold | None = None
        self.replacing, self.old_files, self.written = False, set(), set()
        self.kept_ranks: tuple[int, ...] = ()
        self.kept_bytes = 0

    def begin(self) -> None:
        self.replacing, self.old_files = _committed_files(self.storage, self.plan.spec.overwrite)
        self.hold = self.storage.hold_dir(self.journals, exclusive=True)

    def write(self) -> list[Stored]:
        what, tensors = self.plan.what, self.tensors
        tick = Progress(self.plan.tensor_bytes, self.progress)
        tick.begin()
        by_name = {o.name: o for o in what.outputs}
        values = [DcpBytesItem(key, leaf) for key, _, leaf in self.keyed if not isinstance(leaf, TensorRef)]
        budget = buffer_budget(self.plan.spec.memory_limit, "convert", read_reserve(what.base, 1))
        buffers = SliceBuffers.within(budget, 1, largest_slice(what.outputs), smallest=4 * ALIGN)
        per_element = max((itemsize(o.source.dtype) + itemsize(o.dtype) for _, o in tensors), default=1)
        max_elements = (buffers.nbytes - 2 * ALIGN) // per_element
        file_index = 1 + max((int(_DATA_FILE.fullmatch(f).group(2)) for f in self.old_files
                              if _DATA_FILE.fullmatch(f)), default=-1)
        pieces = ReadOnDemand(what.reader, by_name, None, tick, buffers)
        files = [(rank, ([*values] if rank == 0 else []) +
                  rank_tensor_items(tensors, rank, self.plan.place, max_elements)) for rank in range(what.world)]
        kept: list[int] = []
        stored = write_files([(r, items) for r, items in files if items], lambda job: self._rank_file(
            job, file_index, pieces, buffers, tick, kept), 1)
        self.kept_ranks, self.kept_bytes = tuple(kept), sum(self.storage.file_size(f"__{r}_{file_index}.distcp")
                                                             for r in kept)
        return [s for rank_stored in stored for s in rank_stored]

    def _rank_file(self, job: tuple[int, list], file_index: int, pieces: ReadOnDemand, buffers: SliceBuffers,
                   tick: Progress, kept: list[int]) -> list[Stored]:
        rank, items = job
        path = f"__{rank}_{file_index}.distcp"
        writer = _RankFile(self.storage, path, f"{self.journals}/{path}.json", self.plan.generation, items)
        result = writer.kept(buffers)
        if result is None:
            return writer.write(pieces)
        kept.append(rank)
        tick(sum(i.flat.numel * itemsize(i.output.dtype) for i in items if isinstance(i, DcpTensorItem)))
        return result

    def commit(self, shares: list) -> None:
        raise_failures(shares)
        stored = shares[0]
        try:
            _check_against_source(stored, self.tensors)
        except CorruptCheckpointError:
            self.storage.remove_dir(self.journals)  # else a rerun would keep what was wrong
            raise
        try:
            self.storage.put_atomic(METADATA_NAME, _metadata(self.keyed, self.tensors, stored, self.plan.generation),
                                    exclusive=not self.replacing)
        except FileExistsError:
            raise CheckpointExistsError(f"{self.storage.url(METADATA_NAME)}: a DCP checkpoint was committed here "
                                        "meanwhile; nothing of this conversion was committed") from None
        self.written = {s.path for s in stored}

    def end(self) -> None:
        if self.hold is not None:
            self.hold.release()
        if self.written:  # committed
            _remove_old(self.storage, self.old_files - self.written, self.journals)


def _refuse_per_rank(encoded_tree: Any) -> None:
    """DCP stores one value per key: per-rank values (format v4, ``shardckpt.PerRank``) have no form there."""
    names = per_rank_names(encoded_tree)
    if names:
        raise UnsupportedValueError(f"{', '.join(names)}: per-rank values (shardckpt.PerRank) have no form in DCP, "
                                    f"which stores one value per key; pass exclude={names} to convert the rest "
                                    "(a conversion to the shardckpt format keeps them)")


def _committed_files(storage: Storage, overwrite: bool) -> tuple[bool, set[str]]:
    """Whether a DCP checkpoint is committed at ``storage``, and its data files; refuses one without
    ``overwrite``, and any shardckpt checkpoint there (a directory is one checkpoint, of one format)."""
    if storage.exists(MANIFEST_NAME):
        raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a shardckpt checkpoint is there; convert to "
                                    "DCP in another directory")
    if not storage.exists(METADATA_NAME):
        return False, set()
    if not overwrite:
        raise CheckpointExistsError(f"{storage.url(METADATA_NAME)}: a DCP checkpoint already exists; pass "
                                    "overwrite=True to replace it")
    try:
        return True, set(parse_metadata(storage.read_bytes(METADATA_NAME), storage.url(METADATA_NAME)).files)
    except CheckpointError:  # unreadable: every data file there may be its
        return True, {f for f in storage.list_files() if _DATA_FILE.fullmatch(f)}


class _RankFile:
    """One output rank's ``.distcp`` file and its journal."""

    def __init__(self, storage: Storage, path: str, journal: str, generation: str, items: list):
        self.storage, self.path, self.journal = storage, path, journal
        plan = [[i.key, list(i.offsets), list(i.sizes), [i.flat.start, i.flat.stop], str(i.output.dtype),
                 i.output.source.name] if isinstance(i, DcpTensorItem) else [i.key, repr(i.value)] for i in items]
        self.digest = hashlib.sha256(json.dumps([generation, path, torch.__version__, plan]).encode()).hexdigest()
        self.items = items

    def kept(self, buffers: SliceBuffers) -> list[Stored] | None:
        """What a killed run of this plan wrote of this file, if its journal says it finished it and the bytes
        read back match its CRC32C; else None."""
        try:
            doc = json.loads(self.storage.read_bytes(self.journal))
            if doc.get("digest") != self.digest or self.storage.file_size(self.path) != doc["size"]:
                return None
            crc = 0
            with buffers.take(1) as buffer:
                view = buffer.numpy()
                for lo in range(0, doc["size"], len(view)):
                    part = view[:min(len(view), doc["size"] - lo)]
                    self.storage.read_into(self.path, lo, memoryview(part))
                    crc = crc32c(part, crc)
            if crc != doc["crc32c"]:
                return None
            return [Stored(k, None if o is None else tuple(o), self.path, off, n, tuple(z), c)
                    for k, o, off, n, z, c in doc["items"]]
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, pieces: ReadOnDemand) -> list[Stored]:
        out = _Counting(self.storage.open_writer(self.path))
        stored = []
        try:
            for item in self.items:
                start = out.size
                if isinstance(item, DcpBytesItem):
                    data = io.BytesIO()
                    torch.save(item.value, data)  # as DCP's planner stores a value that is not a tensor
                    out.write(data.getbuffer())
                    stored.append(Stored(item.key, None, self.path, start, out.size - start))
                    continue
                chunk, crc = _chunk(item, pieces)
                torch.save(chunk, out)
                stored.append(Stored(item.key, item.offsets, self.path, start, out.size - start, item.sizes, crc))
        finally:
            out.writer.close()
        doc = {"digest": self.digest, "size": out.size, "crc32c": out.crc,
               "items": [[s.key, None if s.offsets is None else list(s.offsets), s.offset, s.length, list(s.sizes), s.crc]
                         for s in stored]}
        self.storage.put_atomic(self.journal, json.dumps(doc).encode())
        return stored


def _chunk(item: DcpTensorItem, pieces: ReadOnDemand) -> tuple[torch.Tensor, int]:
    """The chunk's elements (read, and cast, into the slice buffer) as a tensor of the box's shape whose storage
    is exactly them (``torch.save`` writes a view's whole storage), and the CRC32C of their bytes."""
    if not item.flat.numel:
        return torch.empty(item.sizes, dtype=item.output.dtype), 0
    slices = list(pieces.stream(item.output, item.flat))
    if len(slices) != 1:
        raise AssertionError(f"{item.key}: chunk {item.offsets} took {len(slices)} slices, not one")
    raw = slices[0].view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=item.output.dtype).view(item.sizes), crc32c(raw)


def _check_against_source(stored: list[Stored], tensors: list[tuple[str, Output]]) -> None:
    """Each tensor's checksum, combined from its chunks' CRCs, is the source's (where the source records one and
    the values are not cast); else ``CorruptCheckpointError`` before anything is committed."""
    terms: dict[str, int] = {}
    shapes = {key: tuple(o.source.shape) for key, o in tensors}
    sizes = {key: itemsize(o.dtype) for key, o in tensors}
    for s in stored:
        if s.offsets is None or not math.prod(s.sizes):
            continue
        shape = shapes[s.key]
        start = sum(a * math.prod(shape[d + 1:]) for d, a in enumerate(s.offsets))
        term = runs_crc_term([(start, 0, math.prod(s.sizes))], [s.crc], sizes[s.key], math.prod(shape))
        terms[s.key] = terms.get(s.key, 0) ^ term
    for key, o in tensors:
        if o.source.crc32c is None or o.dtype != o.source.dtype or not math.prod(o.source.shape):
            continue
        if terms.get(key, 0) != o.source.crc32c:
            raise CorruptCheckpointError(f"{key}: the converted values' checksum {terms.get(key, 0):08x} is not the "
                                         f"source's {o.source.crc32c:08x} (source tensor {o.source.name!r}); nothing "
                                         "was committed: run the conversion again")


def _metadata(keyed: list, tensors: list[tuple[str, Output]], stored: list[Stored], generation: str) -> bytes:
    """torch's ``Metadata`` for the stored items, pickled as ``FileSystemWriter.finish`` pickles it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
        TensorStorageMetadata,
    )

    outputs = dict(tensors)
    state: dict[str, Any] = {}
    for key, _, leaf in keyed:
        if isinstance(leaf, TensorRef):
            o = outputs[key]
            state[key] = TensorStorageMetadata(TensorProperties(dtype=o.dtype), torch.Size(o.source.shape), [])
        else:
            state[key] = BytesStorageMetadata()
    storage_data = {}
    for s in stored:
        if s.offsets is None:
            index = MetadataIndex(s.key)
        else:
            chunks = state[s.key].chunks
            index = MetadataIndex(s.key, torch.Size(s.offsets), len(chunks))
            chunks.append(ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)))
        storage_data[index] = _StorageInfo(s.path, s.offset, s.length)
    metadata = Metadata(state, planner_data={key: path for key, path, _ in keyed}, storage_data=storage_data,
                        storage_meta=StorageMeta(save_id=generation), version=DCP_VERSION)
    return pickle.dumps(metadata)


def _remove_old(storage: Storage, files: set[str], journals: str) -> None:
    """After the commit: the replaced checkpoint's data files, and this conversion's journals."""
    for name in sorted(files):
        remove(storage, name)
    storage.remove_dir(journals)
    if not storage.list_dirs(RESUME_DIR) and not storage.list_files(RESUME_DIR):
        storage.remove_dir(RESUME_DIR)
