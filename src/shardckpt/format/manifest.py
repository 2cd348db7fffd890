"""The manifest (``manifest.json``): the commit point and table of contents of a checkpoint.

See FORMAT.md for the specification. Everything read here is untrusted: every field is checked
before use, and errors name the file and the tensor. From format v2 the manifest carries a CRC32C of
its own bytes in a fixed-width prefix, checked before anything in it is believed.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

import torch

from shardckpt.records import record
from shardckpt.errors import BadArgumentError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.regions import Region
from shardckpt.format.checksum import crc32c
from shardckpt.format.chunks import Chunks, RegularChunks, chunks_from_json
from shardckpt.format.codecs import MAX_RATIO
from shardckpt.format.dtypes import DTYPES, dtype_from_name, dtype_name, itemsize
from shardckpt.format.index import MIN_ROW_BYTES
from shardckpt.format.tensor_table import check_form, read_table, table_to_json
from shardckpt.format.tree import TensorRef, compact_tensor_dicts, decode, leaf_groups
from shardckpt.format.validate import (
    MAX_NUMEL,
    absurd_shape,
    check_fields,
    check_relative_path,
    first_repeat,
    get_field,
    get_int,
    get_list,
    int_field,
    parse_json,
)

FORMAT_NAME = "shardckpt"
FORMAT_VERSION = 6  # the newest version this shardckpt reads and writes
# A save writes the oldest version that holds it, so that older readers read what they can (FORMAT.md,
# "Compatibility"): v2 without compression, v3 with it, v4 when its tree holds per-rank values, v6 when it
# holds many tensors.
UNCOMPRESSED_VERSION = 2
COMPRESSED_VERSION = 3
PER_RANK_VERSION = 4
POOLED_VERSION = 5  # written only by incremental saves: data files in the run directory's pool (format/pool.py)
TABLE_VERSION = 6  # the tensor table and ``$tensors`` (FORMAT.md, "The tensor table")
# From this many tensors a save writes the table: its manifest parses ~5x faster (four JSON objects per tensor
# become list items); smaller checkpoints stay readable by shardckpt releases that predate it.
TABLE_MIN_TENSORS = 1024


def version_for(compressed: bool, per_rank: bool = False, tensors: int = 0) -> int:
    """The format version a save of ``tensors`` tensors writes: v6 from ``TABLE_MIN_TENSORS`` tensors, else v4 if
    its tree holds per-rank values, else v3 if its chunks may be compressed, else v2."""
    if tensors >= TABLE_MIN_TENSORS:
        return TABLE_VERSION
    return PER_RANK_VERSION if per_rank else COMPRESSED_VERSION if compressed else UNCOMPRESSED_VERSION


MANIFEST_NAME = "manifest.json"
POOL_DIR = "shardckpt-pool"  # a pooled checkpoint's pool: its parent directory's child of this name
POOL_PATH = f"../{POOL_DIR}"


def refuse_pool_dir(url: str) -> None:
    """Raise ``BadArgumentError`` if ``url`` names a run's chunk pool: a checkpoint written there would be swept
    with the pool's unnamed data (and its commit's clean-up would take the pool's data for debris)."""
    names = [url] if "://" in url else [url, os.path.realpath(url)]  # local: a link to the pool is the pool
    if any(u.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1] == POOL_DIR for u in names):
        raise BadArgumentError(f"{url}: {POOL_DIR} is the run's chunk pool of incremental checkpoints, not a place "
                               "for a checkpoint; choose another directory")
MAX_WORLD_SIZE = 1 << 24  # the most ranks a manifest may record
# The checksum prefix: exactly these bytes with 8 lowercase hex digits; the CRC32C covers every byte after it.
_SEAL = re.compile(rb'\{"crc32c":"([0-9a-f]{8})",')
_SEAL_LEN = len(b'{"crc32c":"00000000",')
_GENERATION = re.compile(r"^[0-9a-f]{1,64}$")
_TOP_REQUIRED = ("format", "version", "world_size", "generation", "tree", "files", "tensors")
_TOP_OPTIONAL = ("crc32c", "created_by", "metadata", "pool")
_POOL_DATA = re.compile(r"^data-[0-9a-f]{1,64}/")


@record
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
    version: int = FORMAT_VERSION
    checksummed: bool = True  # False only for format v1, whose manifest has no checksum
    pool: dict | None = None  # v5: {"path": "../shardckpt-pool", "id": ...}; file paths are then the pool's

    def to_bytes(self, encoded_tree: Any, table: dict | None = None) -> bytes:
        """The sealed manifest. ``table``: its tensor table (format v6), if the writer made it itself (a save's commit:
        ``checkpoint.save_plan.SavePlan.table``), in place of one made from ``tensors``."""
        if self.version < UNCOMPRESSED_VERSION:
            raise ValueError(f"shardckpt writes format v{UNCOMPRESSED_VERSION} on, not v{self.version}")
        tabled = self.version >= TABLE_VERSION
        doc = {"format": FORMAT_NAME, "version": self.version, "created_by": self.created_by,
               "world_size": self.world_size, "generation": self.generation, "metadata": self.metadata,
               "tree": compact_tensor_dicts(encoded_tree) if tabled else encoded_tree,
               "files": [f.to_json() for f in self.files],
               "tensors": (table if table is not None else table_to_json(self.tensors)) if tabled else
                          {n: t.to_json() for n, t in self.tensors.items()}}
        if self.pool is not None:
            doc["pool"] = self.pool
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def seal(body: bytes) -> bytes:
    """Prefix a JSON object's text with the CRC32C of everything after the prefix (format v2)."""
    if not body.startswith(b"{") or body.startswith(b'{"crc32c"'):
        raise ValueError("seal() takes the text of a JSON object without a checksum")
    rest = body[1:]
    return b'{"crc32c":"%08x",' % crc32c(rest) + rest


def _check_seal(data: bytes, where: str) -> bool:
    """True if ``data`` carries a checksum prefix and it matches; raises if it does not match."""
    m = _SEAL.match(data)
    if m is None:
        return False
    stored, actual = int(m.group(1), 16), crc32c(data[_SEAL_LEN:])
    if stored != actual:
        raise CorruptCheckpointError(f"{where}: the manifest fails its checksum (stored {stored:08x}, computed "
                                     f"{actual:08x}): it is damaged; run `shardckpt verify`")
    return True


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in errors."""
    doc, version = _sealed_doc(data, where)
    return _manifest_from_doc(doc, version, where)


def check_manifest(data: bytes, where: str) -> None:
    """Raise as ``parse_manifest`` would, without making the entry of each tensor of a v6 table (its columns and
    forms are checked all the same): a commit checks the manifest it is about to write."""
    doc, version = _sealed_doc(data, where)
    _manifest_from_doc(doc, version, where, entries=False)


def manifest_generation(data: bytes, where: str) -> str:
    """The generation a manifest names (a save that replaces a checkpoint removes that data directory after its
    commit). A sealed manifest's (v2 on) is read from its checked header alone, its tensors and tree not parsed (100k
    tensors take a second): its checksum vouches that its bytes are as written. A v1 manifest has no checksum: it
    is parsed in full, so that a damaged one names nothing to remove."""
    doc, version = _sealed_doc(data, where)
    return _manifest_from_doc(doc, version, where).generation if version < 2 else _generation(doc, where)


def _sealed_doc(data: bytes, where: str) -> tuple[dict, int]:
    """The manifest's JSON object and format version, its checksum and top-level fields checked."""
    sealed = _check_seal(data, where)
    doc = parse_json(data, where)
    if get_field(doc, "format", where) != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardckpt manifest (format {str(doc.get('format'))[:40]!r})")
    version = int_field(doc, "version", where, 1, 1 << 31)
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpointError(f"{where}: format version {version} is newer than this shardckpt reads "
                                          f"({FORMAT_VERSION}); upgrade shardckpt")
    if version >= 2:
        if not sealed:
            raise CorruptCheckpointError(f"{where}: a format v{version} manifest must begin with its checksum "
                                         '(\'{"crc32c":"<8 hex digits>",\'): the file is damaged')
        check_fields(doc, _TOP_REQUIRED, _TOP_OPTIONAL, where)
    elif sealed:
        raise CorruptCheckpointError(f"{where}: a format v1 manifest has no checksum prefix: the file is damaged")
    return doc, version


def _generation(doc: dict, where: str) -> str:
    generation = get_field(doc, "generation", where)
    if not isinstance(generation, str) or not _GENERATION.match(generation):
        raise CorruptCheckpointError(f"{where}: 'generation' must be 1-64 lowercase hex digits, got "
                                     f"{str(generation)[:80]!r}")
    return generation


def _manifest_from_doc(doc: dict, version: int, where: str, entries: bool = True) -> Manifest | None:
    strict = version >= 2
    generation = _generation(doc, where)
    pool = check_pool_field(doc, version, where)
    data_dir = None if pool is not None else f"data-{generation}/" if strict else ""
    files = [_file_from_json(f, data_dir, strict, f"{where} files[{i}]")
             for i, f in enumerate(get_list(doc, "files", where))]
    seen: set[str] = set()
    for path in (p for f in files for p in (f.path, f.index_path)):
        if path in seen:  # it would count twice towards the bytes that bound the tensors' claims
            raise CorruptCheckpointError(f"{where}: file {path!r} is listed twice")
        seen.add(path)
    tensors_doc = get_field(doc, "tensors", where)
    if not isinstance(tensors_doc, dict):
        raise CorruptCheckpointError(f"{where}: 'tensors' must be an object")
    stored = sum(f.size for f in files)
    if version >= TABLE_VERSION:
        tensors = _tensors_from_table(tensors_doc, files, stored, version, where, entries)
    else:
        checked = _Checked(files, stored, version)
        tensors = {name: checked.entry(name, t, where) for name, t in tensors_doc.items()}
    if not isinstance(doc.get("tree"), dict):
        raise CorruptCheckpointError(f"{where}: 'tree' must be an object (a state dict)")
    tree = decode(doc["tree"], where, per_rank=version >= PER_RANK_VERSION, tables=version >= TABLE_VERSION)
    if not isinstance(tree, dict):  # {"$tuple": ...}, {"$tensor": ...}: no writer saves a root that is not a dict
        raise CorruptCheckpointError(f"{where}: 'tree' must be a state dict (an object, or a $dict), not a "
                                     f"{type(tree).__name__}")
    check_tree(tree, tensors, strict, where)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{where}: 'metadata' must be an object")
    created_by = doc.get("created_by", "")
    if not isinstance(created_by, str):
        raise CorruptCheckpointError(f"{where}: 'created_by' must be a string")
    world_size = int_field(doc, "world_size", where, 1, MAX_WORLD_SIZE)
    if not entries:
        return None
    return Manifest(world_size=world_size, generation=generation, tree=tree, tensors=tensors, files=files,
                    metadata=metadata, created_by=created_by, version=version, checksummed=strict, pool=pool)


def _tensors_from_table(doc: dict, files: list[FileEntry], stored: int, version: int, where: str,
                        entries: bool = True) -> dict[str, TensorEntry] | list[str]:
    """A v6 manifest's tensor table (``format.tensor_table``): each form checked once, as the entry of the first
    tensor that has it (errors name that tensor), then an entry per tensor sharing its form's checked parts
    (without ``entries``: the names alone)."""
    names, crcs, form_of, forms = read_table(doc, where)
    first = dict(zip(reversed(form_of), reversed(names)))  # form -> its first tensor (earlier ones overwrite later)
    checked = [_tensor_from_json(first[i], check_form(form, f"{where} tensors.forms[{i}]"), files, stored, version,
                                 f"{where} tensor {first[i]!r} (tensors.forms[{i}])")
               for i, form in enumerate(forms)]
    if not entries:
        return names
    return {name: TensorEntry(name, e.dtype, e.shape, crc, e.chunks)
            for name, crc, e in zip(names, crcs, map(checked.__getitem__, form_of))}


def check_pool_field(doc: dict, version: int, where: str) -> dict | None:
    """A v5 manifest's ``pool`` (FORMAT.md, "Pooled checkpoints"): present exactly in version 5, exactly
    ``{"path": "../shardckpt-pool", "id": <32 lowercase hex>}``. (Not in v6: a pool's files are shared by the
    checkpoints of a run, and their indexes, written at v5, must have their manifest's version.)"""
    pool = doc.get("pool")
    if version != POOLED_VERSION:
        if pool is not None:
            raise CorruptCheckpointError(f"{where}: 'pool' is a format v{POOLED_VERSION} field, the manifest is "
                                         f"v{version}")
        return None
    if not isinstance(pool, dict):
        raise CorruptCheckpointError(f"{where}: a format v{version} manifest must have a 'pool' object")
    check_fields(pool, ("path", "id"), (), f"{where} pool")
    if pool["path"] != POOL_PATH:
        raise CorruptCheckpointError(f"{where}: pool path must be exactly {POOL_PATH!r}, got {str(pool['path'])[:80]!r}")
    if not isinstance(pool["id"], str) or not re.match(r"^[0-9a-f]{32}$", pool["id"]):
        raise CorruptCheckpointError(f"{where}: pool id must be 32 lowercase hex digits, got {str(pool['id'])[:80]!r}")
    return {"path": pool["path"], "id": pool["id"]}


def _file_from_json(obj: Any, data_dir: str | None, strict: bool, where: str) -> FileEntry:
    if strict:
        check_fields(obj, ("path", "size", "index"), (), where)
    index = get_field(obj, "index", where)
    if strict:
        check_fields(index, ("path", "size", "crc32c"), (), where)
    entry = FileEntry(path=check_relative_path(get_field(obj, "path", where), where),
                      size=int_field(obj, "size", where),
                      index_path=check_relative_path(get_field(index, "path", where), where),
                      index_size=int_field(index, "size", where, 0, 1 << 34),
                      index_crc32c=int_field(index, "crc32c", where, 0, 0xFFFFFFFF))
    for path in (entry.path, entry.index_path):
        if data_dir is None:  # pooled (v5): any generation's directory of the pool
            if not _POOL_DATA.match(path):
                raise CorruptCheckpointError(f"{where}: pool file path {path!r} is outside every data-<generation>/")
        elif not path.startswith(data_dir):
            raise CorruptCheckpointError(f"{where}: file path {path!r} is outside this generation's {data_dir}")
    return entry


def min_stored_bytes(entry: TensorEntry, version: int) -> int:
    """The fewest bytes a tensor's chunks can occupy in its data files: its bytes, or from format v3 (chunks
    may be compressed) its bytes over zstd's largest possible ratio, and at least one byte per chunk.
    Claims beyond what the files could back are refused before any loop over chunks or allocation."""
    if version < COMPRESSED_VERSION:
        return entry.nbytes
    return max(-(-entry.nbytes // MAX_RATIO), len(entry.chunks))


def _claim(entry: TensorEntry, version: int) -> str:
    if version < COMPRESSED_VERSION:
        return f"{entry.nbytes} bytes"
    return f"{entry.nbytes} bytes in {len(entry.chunks)} chunks (at least {min_stored_bytes(entry, version)} stored)"


_TENSOR_FIELDS = frozenset(("dtype", "shape", "crc32c", "chunks"))
_REGULAR_FIELDS = frozenset(("size", "count", "files"))
_AFFINE_FIELDS = frozenset(("first", "step"))


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _fast_regular(name: str, obj: Any, n_files: int) -> TensorEntry | None:
    """The common entry (format v2 on: regular chunks in affine files) checked with plain comparisons, the same
    rules as the general path below; None for anything else, which that path then checks (and names the fault).
    A manifest of many small tensors spends most of its parse here."""
    if type(obj) is not dict or obj.keys() != _TENSOR_FIELDS:
        return None
    name_of_dtype, shape, crc, chunks = obj["dtype"], obj["shape"], obj["crc32c"], obj["chunks"]
    dtype = DTYPES.get(name_of_dtype) if type(name_of_dtype) is str else None
    if dtype is None or type(shape) is not list or len(shape) > 64 or not _is_int(crc, 0, 0xFFFFFFFF):
        return None
    if not all(type(s) is int and 0 <= s <= MAX_NUMEL for s in shape):
        return None
    numel = math.prod(shape)
    if absurd_shape(shape, numel) or type(chunks) is not dict or chunks.keys() != _REGULAR_FIELDS:
        return None
    size, count, placed = chunks["size"], chunks["count"], chunks["files"]
    if not (_is_int(size, 1, MAX_NUMEL) and type(count) is int and count == -(-numel // size)):
        return None
    if type(placed) is not dict or placed.keys() != _AFFINE_FIELDS:
        return None
    first, step = placed["first"], placed["step"]
    if not (_is_int(first, 0, n_files - 1 if count else n_files) and _is_int(step, -n_files, n_files)):
        return None
    if count and not 0 <= first + (count - 1) * step < n_files:
        return None
    return TensorEntry(name, dtype, tuple(shape), crc, RegularChunks(size, count, (first, step), True))


class _Checked:
    """The tensor entries of one manifest, each checked once per distinct form: the many entries of a checkpoint of
    many small tensors that differ only in name and checksum (same dtype, shape and chunk placement, all integers)
    share one check of their form and claims."""

    def __init__(self, files: list[FileEntry], stored: int, version: int):
        self.files, self.stored, self.version = files, stored, version
        self.forms: dict[tuple, TensorEntry] = {}

    def entry(self, name: str, obj: Any, where: str) -> TensorEntry:
        form = _regular_form(obj) if self.version >= 2 else None
        known = self.forms.get(form) if form is not None else None
        if known is not None and 0 <= obj["crc32c"] <= 0xFFFFFFFF:
            return TensorEntry(name, known.dtype, known.shape, obj["crc32c"], known.chunks)
        entry = _tensor_from_json(name, obj, self.files, self.stored, self.version, f"{where} tensor {name!r}")
        if form is not None:
            self.forms[form] = entry
        return entry


_INT = frozenset((int,))


def _regular_form(obj: Any) -> tuple | None:
    """An entry's form (dtype, chunk placement, shape) if it has exactly the fields of a regular entry and its every
    number (its checksum too) is an int (a bool or float never shares a form with an int), else None."""
    try:
        if type(obj) is not dict or len(obj) != 4:
            return None
        chunks, shape, dtype = obj["chunks"], obj["shape"], obj["dtype"]
        if type(chunks) is not dict or len(chunks) != 3 or type(shape) is not list or type(dtype) is not str:
            return None
        placed = chunks["files"]
        if type(placed) is not dict or len(placed) != 2:
            return None
        form = (chunks["size"], chunks["count"], placed["first"], placed["step"], obj["crc32c"], *shape)
    except KeyError:  # (the lengths matched, so a missing field means another field stands in its place)
        return None
    # ``_INT.issuperset`` runs in C: the check costs one call, not one Python step per number.
    return (dtype, *form[:4], *form[5:]) if _INT.issuperset(map(type, form)) else None


def _tensor_from_json(name: str, obj: Any, files: list[FileEntry], stored: int, version: int,
                      where: str) -> TensorEntry:
    strict = version >= 2
    entry = _fast_regular(name, obj, len(files)) if strict else None
    if entry is not None:
        return _check_claims(entry, files, stored, version, where)
    if strict:
        check_fields(obj, ("dtype", "shape", "crc32c", "chunks"), (), where)
    dtype = dtype_from_name(get_field(obj, "dtype", where), where)
    shape_doc = get_field(obj, "shape", where)
    if not isinstance(shape_doc, list) or len(shape_doc) > 64:
        raise CorruptCheckpointError(f"{where}: 'shape' must be a list of at most 64 dims")
    shape = tuple(get_int(s, f"{where} field 'shape'", 0, MAX_NUMEL) for s in shape_doc)
    if absurd_shape(shape, math.prod(shape)):
        raise CorruptCheckpointError(f"{where}: absurd shape {shape}")
    crc = int_field(obj, "crc32c", where, 0, 0xFFFFFFFF)
    entry = TensorEntry(name, dtype, shape, crc, chunks_from_json(get_field(obj, "chunks", where), shape,
                                                                  len(files), strict, where))
    return _check_claims(entry, files, stored, version, where)


def _check_claims(entry: TensorEntry, files: list[FileEntry], stored: int, version: int, where: str) -> TensorEntry:
    """The tensor's bytes and chunk count against what its files can hold (FORMAT.md, ``tensors[name]``)."""
    # O(1) bound first: no loop may run over a count of chunks that the files' bytes could not back.
    claimed = min_stored_bytes(entry, version)
    if claimed > stored:
        raise CorruptCheckpointError(f"{where}: claims {_claim(entry, version)}, all data files hold {stored} bytes")
    chunks = entry.chunks
    if isinstance(chunks, RegularChunks) and chunks.affine and chunks.files[1] != 0:
        return entry  # one chunk per distinct file: the count is bounded by the files (the FSDP case at scale)
    used = chunks.files_used()
    held = sum(files[f].size for f in used)
    if claimed > held:
        raise CorruptCheckpointError(f"{where}: claims {_claim(entry, version)}, its data files hold {held} bytes")
    # Every chunk has a row of at least MIN_ROW_BYTES in its file's index: a count the indexes cannot
    # hold is refused before any per-chunk work (which costs memory per chunk, not per byte).
    rows = sum(files[f].index_size for f in used) // MIN_ROW_BYTES
    if len(chunks) > rows:
        raise CorruptCheckpointError(f"{where}: claims {len(chunks)} chunks, its files' indexes hold at most "
                                     f"{rows} rows")
    return entry


_REFS_ONLY = frozenset((TensorRef,))


def check_tree(tree: Any, tensors: Collection[str], strict: bool, where: str) -> None:
    """Every tensor referenced once, and every leaf's dotted name unique (loads match leaves by that name).
    ``tensors``: the names of the manifest's tensors. Checked a container's leaves at a time (``leaf_groups``)."""
    seen: set[str] = set()
    refs: set[str] = set()
    for _, _, names, values in leaf_groups(tree, lambda v: type(v) is TensorRef):
        if not seen.isdisjoint(names) or len(set(names)) != len(names):
            name = first_repeat([*seen, *names])
            raise CorruptCheckpointError(f"{where}: two entries of the state-dict tree are both named {name!r}")
        seen.update(names)
        every = _REFS_ONLY.issuperset(map(type, values))  # the common group: a dict of tensors
        named = [v.name for v in values] if every else [v.name for v in values if type(v) is TensorRef]
        at = names if every else [name for name, v in zip(names, values) if type(v) is TensorRef]
        if strict and named != at:
            name, ref = next((name, ref) for name, ref in zip(at, named) if name != ref)
            raise CorruptCheckpointError(f"{where}: the tensor at {name!r} is named {ref!r} (a tensor is named by "
                                         "its path)")
        if not refs.isdisjoint(named) or len(set(named)) != len(named):
            raise CorruptCheckpointError(f"{where}: a tensor is referenced twice in the tree")
        refs.update(named)
    if len(refs) != len(tensors) or not refs.issuperset(tensors):
        missing = sorted(refs ^ set(tensors))[:5]
        raise CorruptCheckpointError(f"{where}: tree and tensor table disagree on {missing}")


def chunks_of(entry: TensorEntry) -> Iterator[tuple[int, Region, int]]:
    """``(chunk index, region, file index)`` for every chunk of a tensor."""
    for i in range(len(entry.chunks)):
        yield i, entry.chunks.region(i, entry.numel), entry.chunks.file(i)
