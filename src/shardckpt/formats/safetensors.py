"""safetensors behind the one read interface: a single ``.safetensors`` file, or a Hugging Face directory.

A directory is read through its ``model.safetensors.index.json`` (whose ``weight_map`` names the file of
each tensor), or, without an index, must hold exactly one ``*.safetensors`` file. A shard of a sharded
checkpoint (``<prefix>-0000i-of-0000N.safetensors``, N > 1) is never read as a whole checkpoint: without its
index ``<prefix>.safetensors.index.json`` naming it, it is refused by name (``CorruptCheckpointError``), as a
directory or as the file itself, since that is what an export killed before its index leaves.

The header is parsed here, not by the ``safetensors`` package, through ``io.Storage``, so that local disk and
any fsspec URL (``s3://``, ``memory://``, ...) work alike: opening reads each file's size, its 8-byte
header length and its JSON header, nothing else; ``read`` reads exactly the bytes of the requested
regions, one ranged read per contiguous run of a region (long runs in pieces of ``READ_PIECE`` bytes, so
that the I/O threads share them). A run lands directly in the caller's buffer when it is a CPU tensor of
the stored dtype, else in a small buffer that is then cast and copied (any dtype, any device).

The header and the index are untrusted input, checked in ``formats/safetensors_header.py``; each file an
index names must exist and hold the tensors it is named for (tensors a file holds that the index does not
name are not presented: the index decides which tensors the checkpoint has).

safetensors stores no checksum: ``TensorInfo.crc32c`` is ``None``. A ``BOOL`` byte other than 0 or 1 is
refused when read.

``tree()`` is flat: every tensor name maps to ``TensorRef(name)``. The files' ``__metadata__`` strings appear
under ``tree()["__metadata__"]`` (``METADATA_KEY``): for a single file, its ``__metadata__``; for several,
the entries on which all files agree (Hugging Face's shards all say ``{"format": "pt"}``). No tensor can be
named ``__metadata__``, since a safetensors header reserves that key, so the entry never hides a tensor.
It is left out when empty. ``export_id`` (``EXPORT_ID_KEY``, shardckpt export's token that ties a file to its
index) is not presented there: it is no value of the user's, and two exports of one source hold the same values.
Everything, per file, is on ``SafetensorsReader.metadata``, and the index's own ``metadata`` object on
``SafetensorsReader.index_metadata``.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.requests import CheckedRequest, check_requests
from shardckpt.formats.safetensors_header import (
    EXPORT_ID_KEY, INDEX_NAME, MAX_INDEX_SIZE, METADATA_KEY, SHARD_NAME, SUFFIX, FileHeader, parse_index, read_header,
)
from shardckpt.io import DEFAULT_IO_THREADS, Storage, lifecycle, open_storage
from shardckpt.io.navigate import parent
from shardckpt.regions import contiguous_runs
from shardckpt.tensor_views import as_bytes, copy_into, from_bytes
from shardckpt.storage_options import Options

READ_PIECE = 64 << 20  # bytes per ranged read at most (a longer run is split, so that threads share it)


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in its file


@dataclass(frozen=True)
class _Job:
    name: str
    entry: _Entry
    offset: int  # in the file
    dest: torch.Tensor  # 1-D: the elements this read fills
    direct: bool  # dest is CPU memory of the stored dtype: read straight into it


class SafetensorsReader:
    """A ``CheckpointReader`` over safetensors files under ``storage`` (see the module's docstring).

    ``files`` are paths relative to ``storage``; ``weight_map`` (tensor -> file, from an index) decides which
    tensor is read from which file; without it, every tensor of every file is presented and a name in two
    files is an error. ``from_file``, ``from_directory`` and ``open_safetensors`` build one.
    """

    def __init__(self, storage: Storage, files: Sequence[str], *, weight_map: Mapping[str, str] | None = None,
                 index_metadata: Any = None, where: str | None = None, io_threads: int = DEFAULT_IO_THREADS):
        self.storage, self.io_threads = storage, io_threads
        self.where = where or (storage.url(files[0]) if len(files) == 1 else storage.root)
        self.index_metadata = index_metadata
        files = list(dict.fromkeys(files))
        named: dict[str, list[str]] = {}
        for tensor, file in (weight_map or {}).items():
            named.setdefault(file, []).append(tensor)
        with ThreadPoolExecutor(max(1, min(io_threads, len(files) or 1)), thread_name_prefix="shardckpt-st") as pool:
            headers = list(pool.map(lambda f: self._header(f, named.get(f)), files))
        self.headers = {h.file: h for h in headers}
        self.metadata: dict[str, dict[str, str]] = {h.file: h.metadata for h in headers}
        self._entries: dict[str, _Entry] = {}
        if weight_map is None:
            for h in headers:
                for name, t in h.tensors.items():
                    if name in self._entries:
                        raise CorruptCheckpointError(f"{storage.url(h.file)}: tensor {name!r} is also in "
                                                     f"{storage.url(self._entries[name].file)}")
                    self._entries[name] = _Entry(h.file, t.dtype, t.shape, h.data_start + t.begin)
        else:
            for name, file in weight_map.items():
                h = self.headers[file]
                t = h.tensors.get(name)
                if t is None:
                    raise CorruptCheckpointError(f"{storage.url(file)}: tensor {name!r}, which {self.where} places "
                                                 "in this file, is not in it")
                self._entries[name] = _Entry(file, t.dtype, t.shape, h.data_start + t.begin)
        self._infos = {name: TensorInfo(name, e.dtype, e.shape, None) for name, e in self._entries.items()}

    def _header(self, file: str, tensors: list[str] | None) -> FileHeader:
        try:
            return read_header(self.storage, file)
        except CheckpointError as e:
            if not tensors:
                raise
            more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
            raise type(e)(f"{e} (the index {self.where} places tensor {tensors[0]!r}{more} in this file)") from e

    @classmethod
    def from_file(cls, storage: Storage, name: str, *, io_threads: int = DEFAULT_IO_THREADS) -> SafetensorsReader:
        """The safetensors file ``name`` under ``storage`` (a shard only where its index names it)."""
        refuse_lone_shard(storage, name)
        return cls(storage, [name], io_threads=io_threads)

    @classmethod
    def from_directory(cls, storage: Storage, *, io_threads: int = DEFAULT_IO_THREADS) -> SafetensorsReader:
        """A directory with ``model.safetensors.index.json``, or with exactly one ``*.safetensors`` file (not
        a shard of a sharded checkpoint: ``refuse_lone_shard``)."""
        if storage.exists(INDEX_NAME):
            weight_map, index_metadata = read_index(storage, INDEX_NAME)
            reader = cls(storage, list(dict.fromkeys(weight_map.values())), weight_map=weight_map,
                         index_metadata=index_metadata, where=storage.url(INDEX_NAME), io_threads=io_threads)
            _refuse_other_exports(reader)
            return reader
        found = [n for n in storage.list_files() if n.endswith(SUFFIX)]
        for name in found:
            refuse_lone_shard(storage, name)
        if len(found) != 1:
            some = f": {found[:5]}{' ...' if len(found) > 5 else ''}" if found else ""
            raise CheckpointNotFoundError(f"{storage.root}: no {INDEX_NAME}, and {len(found)} *{SUFFIX} files{some}; "
                                          f"a safetensors directory without an index must hold exactly one")
        return cls.from_file(storage, found[0], io_threads=io_threads)

    # The read interface ----------------------------------------------------------------------------------

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def facts(self) -> Facts:
        return Facts("safetensors", self.where)

    def tree(self) -> Any:
        out: dict[str, Any] = {name: TensorRef(name) for name in self._entries}
        metas = list(self.metadata.values())
        agreed = {k: v for k, v in metas[0].items()
                  if k != EXPORT_ID_KEY and all(m.get(k) == v for m in metas[1:])} if metas else {}
        if agreed:
            out[METADATA_KEY] = agreed
        return out

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.where)
        jobs = [job for c in checked for job in self._jobs(c)]
        if not jobs:
            return
        jobs.sort(key=lambda j: -j.dest.numel() * j.entry.dtype.itemsize)  # biggest first: a short tail
        lifecycle(self.storage).pin(sorted({j.entry.file for j in jobs}))  # pins nest: concurrent reads are fine
        try:
            if len(jobs) == 1 or self.io_threads <= 1:
                for job in jobs:
                    self._run(job)
            else:
                with ThreadPoolExecutor(self.io_threads, thread_name_prefix="shardckpt-st-read") as pool:
                    list(pool.map(self._run, jobs))
        finally:
            lifecycle(self.storage).release()

    def _jobs(self, c: CheckedRequest) -> list[_Job]:
        name = c.info.name
        entry = self._entries[name]
        size = entry.dtype.itemsize
        flat, direct = c.flat, c.as_stored
        step = max(1, READ_PIECE // size)
        jobs = []
        for start, local, count in contiguous_runs(c.region, entry.shape):
            for k in range(0, count, step):
                n = min(step, count - k)
                jobs.append(_Job(name, entry, entry.offset + (start + k) * size,
                                 flat[local + k:local + k + n], direct))
        return jobs

    def _run(self, job: _Job) -> None:
        entry = job.entry
        try:
            if job.direct:
                raw = as_bytes(job.dest)
                self.storage.read_into(entry.file, job.offset, memoryview(raw.numpy()))
            else:
                raw = torch.empty(job.dest.numel() * entry.dtype.itemsize, dtype=torch.uint8)
                self.storage.read_into(entry.file, job.offset, memoryview(raw.numpy()))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e} (reading tensor {job.name!r})") from e
        if entry.dtype == torch.bool and raw.numel() and int(raw.max()) > 1:
            raise CorruptCheckpointError(f"{self.storage.url(entry.file)}: tensor {job.name!r} holds a bool byte "
                                         "other than 0 or 1")
        if not job.direct:
            copy_into(job.dest, from_bytes(raw, entry.dtype, (job.dest.numel(),)))


def read_index(storage: Storage, name: str) -> tuple[dict[str, str], Any]:
    """``weight_map`` and ``metadata`` of the index file ``name`` (size-capped, checked: ``parse_index``)."""
    where = storage.url(name)
    size = storage.file_size(name)
    if size > MAX_INDEX_SIZE:
        raise CorruptCheckpointError(f"{where}: {size} bytes exceed the {MAX_INDEX_SIZE}-byte limit of an index")
    return parse_index(storage.read_bytes(name), where)


def refuse_lone_shard(storage: Storage, name: str) -> None:
    """Raise ``CorruptCheckpointError`` if ``name`` is shard i of N > 1 of a sharded checkpoint
    (``SHARD_NAME``) that its index ``<prefix>.safetensors.index.json`` beside it does not name: alone, it
    holds only part of the checkpoint (an export killed before its index was written leaves just that)."""
    m = SHARD_NAME.fullmatch(name)
    if m is None or int(m["count"]) <= 1:
        return
    index = f"{m['prefix']}{SUFFIX}.index.json"
    shard = f"{storage.url(name)}: shard {int(m['index'])} of {int(m['count'])} of a sharded safetensors checkpoint"
    if not storage.exists(index):
        raise CorruptCheckpointError(f"{shard}, and its index {index} is missing: the export is incomplete (killed "
                                     "before it wrote its index?) or the index was lost. Rerun the export (it "
                                     "resumes where it can), or read a complete copy")
    weight_map, _ = read_index(storage, index)
    if name not in weight_map.values():
        raise CorruptCheckpointError(f"{shard}, which its index {storage.url(index)} does not name: left from "
                                     "another export? Read the directory, as its index describes it")


def _refuse_other_exports(reader: SafetensorsReader) -> None:
    """An index that names its export (``EXPORT_ID_KEY``, as shardckpt's export writes) must find that export's
    files: a file another export wrote (two exports to one object-store path at once) is refused by name."""
    ident = reader.index_metadata.get(EXPORT_ID_KEY) if isinstance(reader.index_metadata, dict) else None
    if ident is None:
        return
    for file, metadata in reader.metadata.items():
        if metadata.get(EXPORT_ID_KEY) != ident:
            raise CorruptCheckpointError(f"{reader.storage.url(file)}: written by another export "
                                         f"({metadata.get(EXPORT_ID_KEY)!r}) than its index {reader.where} "
                                         f"({ident!r}): two exports wrote here at once, or one was interrupted "
                                         "while replacing the other. Export again")


def open_safetensors(path: str | os.PathLike, storage_options: Options | None = None, *,
                     io_threads: int = DEFAULT_IO_THREADS) -> SafetensorsReader:
    """A ``.safetensors`` file, or a directory (index or one file), by local path or fsspec URL."""
    storage = open_storage(path, storage_options)
    if os.fspath(path).rstrip("/").endswith(SUFFIX):
        directory, name = parent(storage)
        return SafetensorsReader.from_file(directory, name, io_threads=io_threads)
    return SafetensorsReader.from_directory(storage, io_threads=io_threads)
