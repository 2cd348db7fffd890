"""The manifest (``manifest.json``), the on-disk contract of format v1, and its per-file chunk indexes.

See FORMAT.md for the specification. Everything read here is untrusted: every field is checked
before use, and errors name the file and the tensor.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

import torch

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.regions import Box, FlatRange, Region, canonical, check_region, check_tiling
from shardckpt.storage.dtypes import dtype_from_name, dtype_name, itemsize
from shardckpt.storage.tree import TensorRef, decode, leaves

FORMAT_NAME = "shardckpt"
FORMAT_VERSION = 1
INDEX_FORMAT_NAME = "shardckpt-index"
MANIFEST_NAME = "manifest.json"
CODECS = ("raw",)
MAX_NUMEL = 1 << 50  # far beyond any real tensor; larger is a hostile or broken manifest
MAX_BYTES = 1 << 62
_GENERATION = re.compile(r"^[0-9a-f]{1,64}$")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def _int(value: Any, where: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptCheckpointError(f"{where}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _get(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}")
    return obj[key]


def check_relative_path(path: Any, where: str) -> str:
    """A data path must stay inside the checkpoint: relative, no '..', a plain character set."""
    if not isinstance(path, str) or not _SAFE_PATH.match(path) or any(p in (".", "..") for p in path.split("/")):
        raise CorruptCheckpointError(f"{where}: unsafe or invalid file path {path!r} (it must stay inside the "
                                     "checkpoint directory)")
    return path


# ----------------------------------------------------------------------------------------------- chunks


@dataclass(frozen=True)
class RegularChunks:
    """Compact form for the common case: chunk ``i`` is flat elements ``[i*size, min((i+1)*size, numel))``.

    Covers dim-0 chunks (``size`` = rows per chunk x row size) and even flat shards. ``files`` is either
    a tuple of file indexes (one per chunk) or ``(first, step)`` meaning chunk ``i`` is in file ``first + i*step``.
    """

    size: int
    count: int
    files: tuple[int, ...]
    affine: bool

    def __len__(self) -> int:
        return self.count

    def region(self, i: int, numel: int) -> Region:
        return FlatRange(i * self.size, min((i + 1) * self.size, numel))

    def file(self, i: int) -> int:
        return self.files[0] + i * self.files[1] if self.affine else self.files[i]

    def overlapping(self, lo: int, hi: int) -> range:
        """Chunks that may hold elements in flat bounds ``[lo, hi)``."""
        if hi <= lo or self.size == 0:
            return range(0)
        return range(lo // self.size, min((hi - 1) // self.size + 1, self.count))

    def to_json(self) -> dict:
        files = {"first": self.files[0], "step": self.files[1]} if self.affine else list(self.files)
        return {"size": self.size, "count": self.count, "files": files}


@dataclass(frozen=True)
class ExplicitChunks:
    """Any tiling: a list of (region, file index)."""

    regions: tuple[Region, ...]
    files: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.regions)

    def region(self, i: int, numel: int) -> Region:
        return self.regions[i]

    def file(self, i: int) -> int:
        return self.files[i]

    def overlapping(self, lo: int, hi: int) -> range:
        return range(len(self.regions))

    def to_json(self) -> list:
        return [dict(region_to_json(r), file=f) for r, f in zip(self.regions, self.files)]


Chunks = Union[RegularChunks, ExplicitChunks]


def region_to_json(region: Region) -> dict:
    if isinstance(region, FlatRange):
        return {"flat": [region.start, region.stop]}
    return {"box": {"offsets": list(region.offsets), "sizes": list(region.sizes)}}


def compact_chunks(regions: Sequence[Region], files: Sequence[int], shape: Sequence[int]) -> Chunks:
    """The most compact description of a tiling (regions sorted by their first element)."""
    numel = math.prod(shape)
    flat = [canonical(r, shape) for r in regions]
    if flat and all(isinstance(r, FlatRange) for r in flat):
        size = flat[0].numel
        if size and len(flat) == -(-numel // size) and \
                all(r.start == i * size and r.stop == min(r.start + size, numel) for i, r in enumerate(flat)):
            step = files[1] - files[0] if len(files) > 1 else 1
            affine = all(f == files[0] + i * step for i, f in enumerate(files))
            return RegularChunks(size, len(flat), (files[0], step) if affine else tuple(files), affine)
    return ExplicitChunks(tuple(flat), tuple(files))


def _region_from_json(obj: Any, shape: tuple[int, ...], where: str) -> Region:
    try:
        if isinstance(obj, dict) and "flat" in obj:
            a, b = obj["flat"]
            region: Region = FlatRange(_int(a, where, 0, MAX_NUMEL), _int(b, where, 0, MAX_NUMEL))
        else:
            box = _get(obj, "box", where)
            offsets = tuple(_int(v, where, 0, MAX_NUMEL) for v in _get(box, "offsets", where))
            sizes = tuple(_int(v, where, 0, MAX_NUMEL) for v in _get(box, "sizes", where))
            region = Box(offsets, sizes)
        check_region(region, shape)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: invalid chunk region {obj!r}: {e}") from None
    return canonical(region, shape)


def _chunks_from_json(obj: Any, shape: tuple[int, ...], n_files: int, where: str) -> Chunks:
    numel = math.prod(shape)
    if isinstance(obj, dict):
        size = _int(_get(obj, "size", where), where, 0, MAX_NUMEL)
        count = _int(_get(obj, "count", where), where, 0, MAX_NUMEL)
        if count != (-(-numel // size) if size else 0) or (numel and not size):
            raise CorruptCheckpointError(f"{where}: {count} chunks of {size} elements do not tile {numel} elements")
        files = _get(obj, "files", where)
        if isinstance(files, dict):
            first = _int(_get(files, "first", where), where, 0, n_files - 1 if count else n_files)
            step = _int(_get(files, "step", where), where, -n_files, n_files)
            if count and not 0 <= first + (count - 1) * step < n_files:
                raise CorruptCheckpointError(f"{where}: chunk file indexes run past the {n_files} files")
            return RegularChunks(size, count, (first, step), True)
        if not isinstance(files, list) or len(files) != count:
            raise CorruptCheckpointError(f"{where}: 'files' must list one file index per chunk")
        return RegularChunks(size, count, tuple(_int(f, where, 0, n_files - 1) for f in files), False)
    if not isinstance(obj, list):
        raise CorruptCheckpointError(f"{where}: 'chunks' must be an object or a list")
    regions = tuple(_region_from_json(c, shape, where) for c in obj)
    files = tuple(_int(_get(c, "file", where), where, 0, n_files - 1) for c in obj)
    try:
        check_tiling(regions, shape)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return ExplicitChunks(regions, files)


# ---------------------------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32c: int
    chunks: Chunks

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def to_json(self) -> dict:
        return {"dtype": dtype_name(self.dtype, self.name), "shape": list(self.shape), "crc32c": self.crc32c,
                "chunks": self.chunks.to_json()}


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    index_path: str
    index_size: int
    index_crc32c: int

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "index": {"path": self.index_path, "size": self.index_size,
                                                                  "crc32c": self.index_crc32c}}


@dataclass
class Manifest:
    world_size: int
    generation: str
    tree: Any  # decoded state-dict tree, tensors as TensorRef
    tensors: dict[str, TensorEntry]
    files: list[FileEntry]
    metadata: dict = field(default_factory=dict)
    created_by: str = ""

    def to_bytes(self, encoded_tree: Any) -> bytes:
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "created_by": self.created_by,
               "world_size": self.world_size, "generation": self.generation, "metadata": self.metadata,
               "tree": encoded_tree, "files": [f.to_json() for f in self.files],
               "tensors": {name: t.to_json() for name, t in self.tensors.items()}}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _no_duplicates(where: str):
    def hook(pairs: list) -> dict:
        out = {}
        for k, v in pairs:
            if k in out:
                raise CorruptCheckpointError(f"{where}: duplicate key {k!r}")
            out[k] = v
        return out
    return hook


def parse_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates(where))
    except (ValueError, RecursionError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in errors."""
    doc = parse_json(data, where)
    if _get(doc, "format", where) != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardckpt manifest (format {doc.get('format')!r})")
    version = _int(_get(doc, "version", where), where, 1, 1 << 31)
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpointError(f"{where}: format version {version} is newer than this shardckpt reads "
                                          f"({FORMAT_VERSION}); upgrade shardckpt")
    files = [_file_from_json(f, f"{where} files[{i}]") for i, f in enumerate(_list(doc, "files", where))]
    tensors_doc = _get(doc, "tensors", where)
    if not isinstance(tensors_doc, dict):
        raise CorruptCheckpointError(f"{where}: 'tensors' must be an object")
    tensors = {name: _tensor_from_json(name, t, len(files), f"{where} tensor {name!r}")
               for name, t in tensors_doc.items()}
    tree = decode(_get(doc, "tree", where), where)
    _check_tree_refs(tree, tensors, where)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{where}: 'metadata' must be an object")
    generation = _get(doc, "generation", where)
    if not isinstance(generation, str) or not _GENERATION.match(generation):
        raise CorruptCheckpointError(f"{where}: 'generation' must be 1-64 lowercase hex digits, got {generation!r}")
    return Manifest(world_size=_int(_get(doc, "world_size", where), where, 1, 1 << 24), generation=generation,
                    tree=tree, tensors=tensors, files=files, metadata=metadata,
                    created_by=str(doc.get("created_by", "")))


def _list(doc: Any, key: str, where: str) -> list:
    value = _get(doc, key, where)
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where}: {key!r} must be a list")
    return value


def _file_from_json(obj: Any, where: str) -> FileEntry:
    index = _get(obj, "index", where)
    return FileEntry(path=check_relative_path(_get(obj, "path", where), where),
                     size=_int(_get(obj, "size", where), where),
                     index_path=check_relative_path(_get(index, "path", where), where),
                     index_size=_int(_get(index, "size", where), where, 0, 1 << 34),
                     index_crc32c=_int(_get(index, "crc32c", where), where, 0, 0xFFFFFFFF))


def _tensor_from_json(name: str, obj: Any, n_files: int, where: str) -> TensorEntry:
    dtype = dtype_from_name(_get(obj, "dtype", where), where)
    shape_doc = _get(obj, "shape", where)
    if not isinstance(shape_doc, list) or len(shape_doc) > 64:
        raise CorruptCheckpointError(f"{where}: 'shape' must be a list of at most 64 dims")
    shape = tuple(_int(s, where, 0, MAX_NUMEL) for s in shape_doc)
    if math.prod(shape) > MAX_NUMEL:
        raise CorruptCheckpointError(f"{where}: absurd shape {shape}")
    crc = _int(_get(obj, "crc32c", where), where, 0, 0xFFFFFFFF)
    return TensorEntry(name, dtype, shape, crc, _chunks_from_json(_get(obj, "chunks", where), shape, n_files, where))


def _check_tree_refs(tree: Any, tensors: dict[str, TensorEntry], where: str) -> None:
    refs = [leaf.name for _, leaf in leaves(tree, lambda v: isinstance(v, TensorRef))
            if isinstance(leaf, TensorRef)]
    if len(refs) != len(set(refs)):
        raise CorruptCheckpointError(f"{where}: a tensor is referenced twice in the tree")
    if set(refs) != set(tensors):
        missing = sorted(set(refs) ^ set(tensors))[:5]
        raise CorruptCheckpointError(f"{where}: tree and tensor table disagree on {missing}")


# ------------------------------------------------------------------------------------------ file indexes


@dataclass(frozen=True)
class ChunkRecord:
    """Where one chunk's bytes sit in a data file."""

    offset: int
    length: int
    crc32c: int  # of the stored bytes
    codec: str


def index_to_bytes(records: dict[tuple[str, int], ChunkRecord]) -> bytes:
    rows = [[name, i, r.offset, r.length, r.crc32c, r.codec] for (name, i), r in records.items()]
    return json.dumps({"format": INDEX_FORMAT_NAME, "version": FORMAT_VERSION, "chunks": rows},
                      separators=(",", ":")).encode()


def parse_index(data: bytes, file: FileEntry, where: str) -> dict[tuple[str, int], ChunkRecord]:
    doc = parse_json(data, where)
    if _get(doc, "format", where) != INDEX_FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardckpt chunk index")
    out: dict[tuple[str, int], ChunkRecord] = {}
    for row in _list(doc, "chunks", where):
        if not (isinstance(row, list) and len(row) == 6 and isinstance(row[0], str)):
            raise CorruptCheckpointError(f"{where}: malformed chunk row {str(row)[:80]}")
        name, i = row[0], _int(row[1], where, 0, MAX_NUMEL)
        rec = ChunkRecord(_int(row[2], where), _int(row[3], where), _int(row[4], where, 0, 0xFFFFFFFF), row[5])
        if rec.codec not in CODECS:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i}: unknown codec {rec.codec!r}")
        if rec.offset + rec.length > file.size:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i} runs past the end of {file.path} "
                                         f"({rec.offset}+{rec.length} > {file.size} bytes)")
        if (name, i) in out:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i} is listed twice")
        out[(name, i)] = rec
    return out


def chunks_of(entry: TensorEntry) -> Iterator[tuple[int, Region, int]]:
    """``(chunk index, region, file index)`` for every chunk of a tensor."""
    for i in range(len(entry.chunks)):
        yield i, entry.chunks.region(i, entry.numel), entry.chunks.file(i)
