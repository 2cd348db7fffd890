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

The header is untrusted input, checked like the reference implementation checks it (and every check names
the file, and the tensor where there is one): the header length is capped (``MAX_HEADER_SIZE``, 100 MB, the
reference's limit) and must fit in the file; the header must be UTF-8 JSON, an object, without duplicate
keys or non-finite constants; every tensor has a known ``dtype``, a ``shape`` of non-negative integers and
``data_offsets`` ``[begin, end]`` whose length is the shape's byte size; the tensors tile the data that
follows the header exactly, in any order: no overlap, no hole, no trailing bytes (the format forbids holes,
so that a file cannot be two things at once). ``__metadata__``, if present, maps strings to strings.
An index must be a JSON object whose ``weight_map`` maps tensor names to relative paths inside the
directory; each file it names must exist and hold the tensors it is named for (tensors a file holds that
the index does not name are not presented: the index decides which tensors the checkpoint has).

safetensors stores no checksum: ``TensorInfo.crc32c`` is ``None``. A ``BOOL`` byte other than 0 or 1 is
refused when read.

``tree()`` is flat: every tensor name maps to ``TensorRef(name)``. The files' ``__metadata__`` strings appear
under ``tree()["__metadata__"]`` (``METADATA_KEY``): for a single file, its ``__metadata__``; for several,
the entries on which all files agree (Hugging Face's shards all say ``{"format": "pt"}``). No tensor can be
named ``__metadata__``, since a safetensors header reserves that key, so the entry never hides a tensor.
It is left out when empty. Everything, per file, is on ``SafetensorsReader.metadata``, and the index's own
``metadata`` object on ``SafetensorsReader.index_metadata``.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError,
)
from shardckpt.format.tree import TensorRef
from shardckpt.format.validate import MAX_NUMEL
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.formats.requests import CheckedRequest, check_requests
from shardckpt.formats.untrusted import shown
from shardckpt.io import DEFAULT_IO_THREADS, Storage, open_storage, split_url
from shardckpt.regions import contiguous_runs
from shardckpt.tensor_views import as_bytes, from_bytes

SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
MAX_HEADER_SIZE = 100_000_000  # bytes; the reference implementation's limit
MAX_INDEX_SIZE = 100_000_000  # bytes of model.safetensors.index.json
READ_PIECE = 64 << 20  # bytes per ranged read at most (a longer run is split, so that threads share it)
EXPORT_ID_KEY = "export_id"  # in the index's metadata and each file's __metadata__: one export's files
# A shard's name, as huggingface_hub writes it (model-00001-of-00004.safetensors), and anything after it (an
# export's temporary name).
SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<index>[0-9]+)-of-(?P<count>[0-9]+)\.safetensors(?P<rest>.*)", re.S)

# safetensors' dtype names -> torch's. The names are the format's (safetensors' Rust ``Dtype``); the ones
# mapped to None (sub-byte floats) have no torch dtype with the same element count.
_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
    "F4": None, "F6_E2M3": None, "F6_E3M2": None,
}
DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items() if v and hasattr(torch, v)}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


# ---------------------------------------------------------------------------------------------------------
# Parsing (pure)


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite constant {name}")


def load_json(data: bytes, where: str, what: str) -> Any:
    """Untrusted JSON: UTF-8, no duplicate keys, no NaN/Infinity, nesting within Python's stack."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: {what} is not UTF-8 ({e})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise CorruptCheckpointError(f"{where}: {what} has the key {e.key!r} twice") from None
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON ({str(e)[:200]})") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of a header: ``data_offsets`` ``[begin, end)`` count from the first byte after the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def dtype_of(name: Any, where: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name; ``where`` names the file and tensor."""
    if isinstance(name, str) and name in DTYPES:
        return DTYPES[name]
    if isinstance(name, str) and name in _DTYPE_NAMES:
        raise IncompatibleCheckpointError(f"{where}: dtype {name} has no torch dtype in torch {torch.__version__}")
    raise CorruptCheckpointError(f"{where}: unknown dtype {shown(name)} (known: {', '.join(_DTYPE_NAMES)})")


def parse_header(header: bytes, data_len: int, where: str) -> tuple[dict[str, HeaderTensor], dict[str, str]]:
    """The tensors and ``__metadata__`` of a safetensors header, checked against the ``data_len`` bytes after it."""
    obj = load_json(header, where, "the safetensors header")
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: the safetensors header is not a JSON object")
    metadata = obj.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CorruptCheckpointError(f"{where}: {METADATA_KEY} must map strings to strings")
    tensors: dict[str, HeaderTensor] = {}
    for name, entry in obj.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{at}: its header entry is not a JSON object")
        dtype = dtype_of(entry.get("dtype"), at)
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(_is_int(d) and 0 <= d <= MAX_NUMEL for d in shape)):
            raise CorruptCheckpointError(f"{at}: shape {shown(shape)} is not a list of non-negative integers "
                                         f"up to {MAX_NUMEL}")
        if math.prod(max(d, 1) for d in shape) > MAX_NUMEL:  # a 0 beside absurd sizes still has no storage
            raise CorruptCheckpointError(f"{at}: shape {shown(shape)} is absurdly large")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CorruptCheckpointError(f"{at}: data_offsets {shown(offsets)} is not [begin, end] with "
                                         "0 <= begin <= end")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CorruptCheckpointError(f"{at}: data_offsets [{begin}, {end}) hold {end - begin} bytes, its "
                                         f"dtype and shape {tuple(shape)} need {nbytes}")
        if end > data_len:
            raise CorruptCheckpointError(f"{at}: data_offsets [{begin}, {end}) run past the end of the file "
                                         f"({data_len} bytes of data after the header)")
        tensors[name] = HeaderTensor(dtype, tuple(shape), begin, end)
    pos, before = 0, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin < pos:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} at data bytes [{t.begin}, {t.end}) overlaps "
                                         f"tensor {before!r}, which ends at {pos}")
        if t.begin > pos:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: data bytes [{pos}, {t.begin}) before it "
                                         "belong to no tensor (safetensors leaves no holes)")
        pos, before = t.end, name
    if pos != data_len:
        raise CorruptCheckpointError(f"{where}: the last {data_len - pos} bytes of the file belong to no tensor "
                                     "(safetensors leaves no holes)")
    return tensors, metadata


def safe_relative_path(path: Any) -> bool:
    """Whether ``path`` names a file inside a directory: relative, ``/``-separated, no ``..`` or empty parts."""
    return (isinstance(path, str) and path != "" and not path.startswith("/") and "\\" not in path
            and "\0" not in path and "://" not in path and not (len(path) > 1 and path[1] == ":")
            and all(part not in ("", ".", "..") for part in path.split("/")))


def parse_index(data: bytes, where: str) -> tuple[dict[str, str], Any]:
    """``weight_map`` (tensor -> file) and the ``metadata`` object of a ``model.safetensors.index.json``."""
    obj = load_json(data, where, "the index")
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise CorruptCheckpointError(f"{where}: the index is not a JSON object with a \"weight_map\" object")
    weight_map = obj["weight_map"]
    for tensor, file in weight_map.items():
        if not safe_relative_path(file):
            raise CorruptCheckpointError(f"{where}: tensor {tensor!r} is placed in {str(file)[:100]!r}, which is "
                                         "not a relative path inside the directory")
    return weight_map, obj.get("metadata")


# ---------------------------------------------------------------------------------------------------------
# The reader


@dataclass(frozen=True)
class FileHeader:
    """A safetensors file's parsed header; ``data_start`` is the file offset of its first data byte."""

    file: str
    size: int
    data_start: int
    tensors: dict[str, HeaderTensor]
    metadata: dict[str, str]


def read_header(storage: Storage, file: str) -> FileHeader:
    """Read and check ``file``'s header: its size, 8 bytes of header length, then the header; nothing else."""
    where = storage.url(file)
    size = storage.file_size(file)
    if size < 8:
        raise CorruptCheckpointError(f"{where}: {size} bytes are too few for a safetensors file (8-byte header "
                                     "length first)")
    raw = bytearray(8)
    storage.read_into(file, 0, memoryview(raw))
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_SIZE:
        raise CorruptCheckpointError(f"{where}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit")
    if 8 + n > size:
        raise CorruptCheckpointError(f"{where}: header length {n} runs past the end of the file ({size} bytes)")
    header = bytearray(n)
    storage.read_into(file, 8, memoryview(header))
    tensors, metadata = parse_header(header, size - 8 - n, where)
    return FileHeader(file, size, 8 + n, tensors, metadata)


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

    def tree(self) -> Any:
        out: dict[str, Any] = {name: TensorRef(name) for name in self._entries}
        metas = list(self.metadata.values())
        agreed = {k: v for k, v in metas[0].items() if all(m.get(k) == v for m in metas[1:])} if metas else {}
        if agreed:
            out[METADATA_KEY] = agreed
        return out

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.where)
        jobs = [job for c in checked for job in self._jobs(c)]
        if not jobs:
            return
        jobs.sort(key=lambda j: -j.dest.numel() * j.entry.dtype.itemsize)  # biggest first: a short tail
        self.storage.pin(sorted({j.entry.file for j in jobs}))  # pins nest: concurrent reads are fine
        try:
            if len(jobs) == 1 or self.io_threads <= 1:
                for job in jobs:
                    self._run(job)
            else:
                with ThreadPoolExecutor(self.io_threads, thread_name_prefix="shardckpt-st-read") as pool:
                    list(pool.map(self._run, jobs))
        finally:
            self.storage.release()

    def _jobs(self, c: CheckedRequest) -> list[_Job]:
        name = c.info.name
        entry = self._entries[name]
        size = entry.dtype.itemsize
        flat = c.flat
        direct = (flat.device.type == "cpu" and flat.dtype == entry.dtype and not flat.is_conj()
                  and not flat.is_neg())
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
            job.dest.copy_(from_bytes(raw, entry.dtype, (job.dest.numel(),)))


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


def open_safetensors(path: str | os.PathLike, storage_options: dict | None = None, *,
                     io_threads: int = DEFAULT_IO_THREADS) -> SafetensorsReader:
    """A ``.safetensors`` file, or a directory (index or one file), by local path or fsspec URL."""
    path = os.fspath(path)
    if path.rstrip("/").endswith(SUFFIX):
        parent, name = split_url(path)
        return SafetensorsReader.from_file(open_storage(parent, storage_options), name, io_threads=io_threads)
    return SafetensorsReader.from_directory(open_storage(path, storage_options), io_threads=io_threads)
