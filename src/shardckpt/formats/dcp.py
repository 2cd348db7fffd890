"""torch.distributed.checkpoint (DCP) directories behind the one read interface: FSDP1 (ShardedTensor),
FSDP2 (DTensor) and torchtitan-style checkpoints written by DCP's ``FileSystemWriter`` (or its fsspec
subclass), on local disk or any fsspec URL.

The layout, as torch 2.13 writes it:

- ``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata``. ``state_dict_metadata``
  maps each flattened key (the dotted path, e.g. ``model.layers.0.weight``,
  ``optim.state.layers.0.weight.exp_avg``) to a ``TensorStorageMetadata`` (dtype, global size, chunks
  as ``offsets``/``sizes`` boxes) or a ``BytesStorageMetadata`` (any other value); ``storage_data`` maps
  ``MetadataIndex(fqn, chunk offsets)`` to ``_StorageInfo(relative_path, offset, length,
  transform_descriptors)``; ``planner_data`` maps each flattened key to its path in the nested state dict.
- ``__<rank>_<n>.distcp``: items back to back. A tensor chunk is a whole ``torch.save`` archive of that
  chunk (a zip, stored uncompressed); a bytes entry is ``torch.save(value)``.

**The metadata is never unpickled with pickle's defaults.** ``_MetadataUnpickler.find_class`` admits
exactly the globals torch 2.13's ``.metadata`` references (``ADMITTED_GLOBALS``; found by unpickling
real FSDP1 and FSDP2 checkpoints with a recording ``find_class``): DCP's metadata classes, ``torch.Size``,
torch dtypes, the layout helper, the memory-format enum and ``pathlib`` paths. Each but ``torch.Size`` and
the dtype objects maps to an inert stand-in defined here (records that take only their fields, layout names
and paths kept as strings), so no DCP or pathlib code runs while unpickling, nothing unpickled is ever
called, and this module needs no ``torch.distributed`` import. Any other global
raises ``CorruptCheckpointError`` naming the file and the global. The result is then validated: types,
non-negative shapes, chunks inside their tensor and tiling it exactly, every chunk's storage entry inside
its file (checked against the file's size, so a truncated ``.distcp`` is caught at open).

**Reads are ranged.** A chunk's ``torch.save`` archive is opened as a zip through ranged reads (central
directory, ``data.pkl``, the storage record's local header: a few small reads, cached per chunk). Its
``data.pkl`` is interpreted by a second closed unpickler (``torch._utils._rebuild_tensor_v2``/``_v3``,
storage types, ``OrderedDict``, dtypes) that only records the storage offset, size and strides; then only
the byte runs a request needs are read. With ``verify=True`` (the default) every chunk a read touches is
read whole once and checked against the zip's CRC-32 of its storage record, the one checksum DCP keeps;
``verify=False`` reads just the needed span. An archive that is not this simple shape (tensor subclasses,
conj/neg bits, compressed records) is loaded whole with ``torch.load(weights_only=True)``.

**Plain values** (``tree()``): loaded on first call, each bytes entry with ``torch.load(weights_only=True)``
(``io.BytesIO`` admitted, which torchtitan's train state used; anything else torch refuses raises
``IncompatibleCheckpointError``). The tree is the saved nesting rebuilt from ``planner_data`` (dicts,
and lists for integer path components, as DCP itself unflattens), with ``TensorRef(key)`` for tensors;
where ``planner_data`` is missing or inconsistent with the keys (a custom planner, ``flatten_state_dict=
False``), it is the flat dict key -> value.

Not supported (refused with a clear error): stream transforms (``transform_descriptors``: DCP's experimental
compression/extension streams), DCP's safetensors serialization (``SerializationFormat.SAFETENSORS``) and
other storage writers' ``storage_data``, big-endian archives, non-strided (sparse) tensors, dtypes outside
``format.dtypes``.
"""
from __future__ import annotations

import bisect
import contextlib
import io
import math
import pickle
import re
import struct
import threading
import zipfile
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.tree import MAX_DEPTH, TensorRef
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.io import DEFAULT_IO_THREADS, Storage
from shardckpt.regions import Box, Region, check_region, check_tiling, flat_bounds, intersect, local_span, \
    strided_view, strides
from shardckpt.tensor_views import from_bytes, view_of

METADATA_NAME = ".metadata"
_SUPPORTED_DTYPES = frozenset(DTYPES.values())
_ZIP_MAGIC = b"PK\x03\x04"


def is_dcp_dir(storage: Storage) -> bool:
    """Whether ``storage`` holds a torch DCP checkpoint (a ``.metadata`` file), for format detection."""
    return storage.exists(METADATA_NAME)


# --- the .metadata unpickler: inert stand-ins for exactly what torch 2.13's .metadata references ---------------

class _Record:
    """A DCP metadata object as plain attributes (what the dataclass's pickled ``__dict__`` holds)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # (None, slot state)
            state = state[1]
        if not isinstance(state, dict) or not all(isinstance(k, str) and not k.startswith("_") for k in state):
            raise ValueError(f"{type(self).__name__[1:]} has a state that is not its fields")
        self.__dict__.update(state)


def _attr(record: _Record, name: str, default: Any = None) -> Any:
    """A field of an unpickled record (its ``__dict__`` only: nothing it holds is ever called)."""
    return record.__dict__.get(name, default)


class _Metadata(_Record):
    pass


class _TensorStorageMetadata(_Record):
    pass


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_Record):
    pass


class _MetadataIndex(_Record):
    pass


class _StorageMeta(_Record):
    pass


class _StorageInfo(_Record):
    pass


class _TensorProperties(_Record):
    """``TensorProperties.__getstate__`` pickles ``(dtype, layout, requires_grad, memory_format_code, pin_memory)``."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            if len(state) != 5:
                raise ValueError(f"TensorProperties state has {len(state)} fields, expected 5")
            state = dict(zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), state))
        super().__setstate__(state)


def _mem_format(code: Any) -> int:
    """``_MEM_FORMAT_ENCODING(code)``: contiguous, channels_last or preserve (the value is not used)."""
    if type(code) is not int or code not in (0, 1, 2):
        raise ValueError(f"unknown memory-format code {code!r}")
    return code


def _layout(name: Any) -> str:
    """``torch.serialization._get_layout(name)``: kept as its name (only ``torch.strided`` is read)."""
    if not isinstance(name, str):
        raise ValueError(f"layout name {name!r} is not a string")
    return name


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(...)`` (``StorageMeta.checkpoint_id``, informational): kept as a string."""
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("a path made of non-strings")
    return "/".join(parts)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ADMITTED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_METADATA, "Metadata"): _Metadata,
    (_DCP_METADATA, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP_METADATA, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP_METADATA, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP_METADATA, "TensorProperties"): _TensorProperties,
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _mem_format,
    (_DCP_METADATA, "MetadataIndex"): _MetadataIndex,
    (_DCP_METADATA, "StorageMeta"): _StorageMeta,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("pathlib", "Path"): _path,
    # and ("torch", <name>) for every torch dtype object (torch.float32, torch.bfloat16, ...): _TORCH_DTYPES
}
_TORCH_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str):
        super().__init__(io.BytesIO(data))
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        admitted = ADMITTED_GLOBALS.get((module, name))
        if admitted is None and module == "torch":
            admitted = _TORCH_DTYPES.get(name)
        if admitted is None:
            raise CorruptCheckpointError(f"{self.url}: refused to unpickle the global {module}.{name}: a DCP "
                                         ".metadata holds only DCP's metadata classes, torch sizes and dtypes")
        return admitted

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError(f"{self.url}: refused a persistent id in the pickled metadata")


def _unpickle_metadata(data: bytes, url: str) -> _Metadata:
    try:
        md = _MetadataUnpickler(data, url).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a damaged pickle
        raise CorruptCheckpointError(f"{url}: not a readable DCP metadata pickle ({e.__class__.__name__}: {e})") \
            from None
    if not isinstance(md, _Metadata):
        raise CorruptCheckpointError(f"{url}: the pickle holds a {type(md).__name__}, not DCP Metadata")
    return md


# --- validation: the unpickled records -> the reader's own plain description ----------------------------------

@dataclass(frozen=True)
class _Item:
    """One stored item: a tensor chunk's or a bytes entry's ``torch.save`` archive in a data file."""

    path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class _Chunk:
    box: Box
    item: _Item


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[_Chunk, ...]  # as stored
    live: tuple[_Chunk, ...]  # the non-empty ones, by their flat bounds
    starts: tuple[int, ...]  # live chunks' flat bounds
    ends: tuple[int, ...]
    disjoint: bool  # the live chunks' flat bounds do not overlap (dim-0 shards): bisect on them


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} {value!r} is not a sequence of non-negative ints")
    return tuple(value)


_SAFE_PATH = re.compile(r"^[^/\\:]+(/[^/\\:]+)*$")


def _item(info: Any, what: str) -> _Item:
    if not isinstance(info, _StorageInfo):
        raise ValueError(f"{what} has storage info of type {type(info).__name__} (not DCP's FileSystemWriter layout; "
                         "safetensors or another storage writer?)")
    path, offset, length = _attr(info, "relative_path"), _attr(info, "offset"), _attr(info, "length")
    if not isinstance(path, str) or not _SAFE_PATH.match(path) or any(p in (".", "..") for p in path.split("/")):
        raise ValueError(f"{what} names the file {path!r}, not a plain relative path")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise ValueError(f"{what} has byte range offset={offset!r} length={length!r}")
    transforms = _attr(info, "transform_descriptors")
    if transforms is None:
        transforms = ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise ValueError(f"{what} has transform descriptors {transforms!r}")
    return _Item(path, offset, length, tuple(transforms))


def _entry_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    if not isinstance(index, _MetadataIndex) or not isinstance(_attr(index, "fqn"), str):
        raise ValueError(f"storage_data has a key of type {type(index).__name__}, not a MetadataIndex")
    fqn, offset = _attr(index, "fqn"), _attr(index, "offset")
    return fqn, None if offset is None else _ints(offset, f"storage key {fqn!r} offset")


def _tensor(name: str, meta: Any, items: dict, url: str) -> _Tensor:
    props = _attr(meta, "properties")
    if not isinstance(props, _TensorProperties):
        raise ValueError("no TensorProperties")
    dtype = _attr(props, "dtype")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r}")
    if dtype not in _SUPPORTED_DTYPES:
        raise IncompatibleCheckpointError(f"{url}: tensor {name!r} has dtype {dtype}, which shardckpt does not read "
                                          f"(known: {', '.join(DTYPES)})")
    if _attr(props, "layout", "torch.strided") != "torch.strided":
        raise IncompatibleCheckpointError(f"{url}: tensor {name!r} has layout {_attr(props, 'layout')}; only strided "
                                          "(dense) tensors are read")
    shape = _ints(_attr(meta, "size"), "size")
    chunks_meta = _attr(meta, "chunks")
    if not isinstance(chunks_meta, list):
        raise ValueError(f"chunks of type {type(chunks_meta).__name__}")
    chunks = []
    for c in chunks_meta:
        if not isinstance(c, _ChunkStorageMetadata):
            raise ValueError(f"a chunk of type {type(c).__name__}")
        box = Box(_ints(_attr(c, "offsets"), "chunk offsets"), _ints(_attr(c, "sizes"), "chunk sizes"))
        check_region(box, shape)
        item = items.pop((name, box.offsets), None)
        if item is None:
            raise ValueError(f"the chunk at offsets {box.offsets} has no storage entry")
        if not item.transforms and item.length < box.numel * dtype.itemsize:
            raise ValueError(f"the chunk at offsets {box.offsets} has {item.length} bytes in {item.path}, its "
                             f"{box.numel} elements need {box.numel * dtype.itemsize}")
        chunks.append(_Chunk(box, item))
    try:
        check_tiling([c.box for c in chunks], shape)
    except ValueError as e:
        raise ValueError(f"the chunks do not tile shape {shape}: {e}") from None
    live = sorted((c for c in chunks if c.box.numel), key=lambda c: flat_bounds(c.box, shape))
    bounds = [flat_bounds(c.box, shape) for c in live]
    disjoint = all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:]))
    return _Tensor(name, dtype, shape, tuple(chunks), tuple(live), tuple(b[0] for b in bounds),
                   tuple(b[1] for b in bounds), disjoint)


@dataclass(frozen=True)
class DcpLayout:
    """The validated metadata: tensors and bytes entries by key, the nesting paths, the DCP version."""

    tensors: dict[str, _Tensor]
    values: dict[str, _Item]  # bytes entries
    paths: dict[str, tuple] | None  # key -> path in the nested state dict (planner_data), when consistent
    version: str | None
    files: tuple[str, ...]


def parse_metadata(data: bytes, url: str) -> DcpLayout:
    """Unpickle (closed allow-list) and validate a ``.metadata`` file; ``url`` names it in errors."""
    md = _unpickle_metadata(data, url)
    try:
        return _validate(md, url)
    except ValueError as e:
        raise CorruptCheckpointError(f"{url}: {e}") from None


def _validate(md: _Metadata, url: str) -> DcpLayout:
    version = _attr(md, "version")
    if version is not None and (not isinstance(version, str) or not version.startswith("1.")):
        raise IncompatibleCheckpointError(f"{url}: written by DCP metadata version {version!r}; this reader knows 1.x")
    sdm, sd = _attr(md, "state_dict_metadata"), _attr(md, "storage_data")
    if not isinstance(sdm, dict) or not all(isinstance(k, str) for k in sdm):
        raise ValueError("state_dict_metadata is not a dict by key")
    if not isinstance(sd, dict):
        raise ValueError(f"storage_data is a {type(sd).__name__}, not a dict (not DCP's FileSystemWriter layout)")
    items: dict[tuple[str, tuple[int, ...] | None], _Item] = {}
    for index, info in sd.items():
        key = _entry_key(index)
        if key in items:
            raise ValueError(f"storage_data has two entries for {key[0]!r} at offsets {key[1]}")
        items[key] = _item(info, f"storage entry {key[0]!r}")
    tensors, values = {}, {}
    for name, meta in sdm.items():
        if isinstance(meta, _TensorStorageMetadata):
            try:
                tensors[name] = _tensor(name, meta, items, url)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None
        elif isinstance(meta, _BytesStorageMetadata):
            item = items.pop((name, None), None)
            if item is None:
                raise ValueError(f"value {name!r} has no storage entry")
            values[name] = item
        else:
            raise ValueError(f"entry {name!r} has metadata of type {type(meta).__name__}")
    if items:
        (name, offsets), _ = next(iter(items.items()))
        raise ValueError(f"storage_data has {len(items)} entries for no chunk or value, e.g. {name!r} at {offsets}")
    files = sorted({c.item.path for t in tensors.values() for c in t.chunks} | {i.path for i in values.values()})
    return DcpLayout(tensors, values, _paths(_attr(md, "planner_data"), list(sdm)), version, tuple(files))


def _paths(planner_data: Any, keys: list[str]) -> dict[str, tuple] | None:
    """DCP's default planner's key -> nested path map, if it is one and agrees with the keys; else None."""
    if not isinstance(planner_data, dict) or set(planner_data) != set(keys):
        return None
    for key, path in planner_data.items():
        if not isinstance(path, tuple) or not 0 < len(path) <= MAX_DEPTH or \
                not all(type(p) in (str, int) for p in path) or ".".join(map(str, path)) != key:
            return None
    return {k: planner_data[k] for k in keys}


_HOLE = object()  # a list slot no path filled (None in the result, as DCP pads lists)


def _nest(paths: dict[str, tuple], leaf: Mapping[str, Any]) -> Any:
    """Rebuild the nesting as DCP's ``set_element`` does (int path components make lists); None on a conflict."""
    root: dict = {}
    made = {id(root)}  # containers built here; a path may not descend into a leaf value
    lists: list[list] = []
    for key, path in paths.items():
        node: Any = root
        for i, part in enumerate(path):
            if isinstance(node, list):
                if type(part) is not int:
                    return None
                node.extend([_HOLE] * (part + 1 - len(node)))
                current = node[part]
            else:
                if type(part) is not str:
                    return None
                current = node.get(part, _HOLE)
            if i == len(path) - 1:
                if current is not _HOLE:
                    return None
                node[part] = leaf[key]
                break
            want_list = type(path[i + 1]) is int
            if current is _HOLE:
                current = [] if want_list else {}
                made.add(id(current))
                if want_list:
                    lists.append(current)
                node[part] = current
            elif id(current) not in made or isinstance(current, list) != want_list:
                return None
            node = current
    for lst in lists:
        lst[:] = [None if v is _HOLE else v for v in lst]
    return root


# --- a chunk's torch.save archive: where its elements are -----------------------------------------------------

_LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16, "CharStorage": torch.int8,
    "ByteStorage": torch.uint8, "BoolStorage": torch.bool, "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


class _NotSimple(Exception):
    """The archive is not one plain dense tensor in the shape this module reads directly."""


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorDesc:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _desc(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: Any, metadata: Any) -> _TensorDesc:
    if metadata or not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype) or \
            not isinstance(size, tuple) or not isinstance(stride, tuple):  # conj/neg bits, or not a plain tensor
        raise _NotSimple("not a plain tensor")
    return _TensorDesc(storage, storage_offset, tuple(size), tuple(stride), dtype)


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _desc(storage, storage_offset, size, stride, getattr(storage, "dtype", None), metadata)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    return _desc(storage, storage_offset, size, stride, dtype, metadata)


class _UntypedStorage:  # a marker: its records are bytes
    pass


class _TensorPickle(pickle.Unpickler):
    """Reads a ``torch.save``'d plain tensor's ``data.pkl`` into a ``_TensorDesc``; anything else is ``_NotSimple``."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _LEGACY_STORAGE_DTYPES:
            return _LEGACY_STORAGE_DTYPES[name]
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _UntypedStorage
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
        raise _NotSimple(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise _NotSimple("persistent id")
        kind = pid[1]
        dtype = torch.uint8 if kind is _UntypedStorage else kind
        if not isinstance(dtype, torch.dtype):
            raise _NotSimple("storage type")
        return _StorageRef(dtype, pid[2], pid[4])


class _ItemFile(io.RawIOBase):
    """One item's byte range of a data file as a seekable file, read through ``Storage.read_into``."""

    def __init__(self, storage: Storage, item: _Item):
        super().__init__()
        self.storage, self.item, self.pos = storage, item, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.item.length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the item")
        self.pos = base + pos
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.item.length - self.pos))
        if n:
            self.storage.read_into(self.item.path, self.item.offset + self.pos, memoryview(b).cast("B")[:n])
        self.pos += n
        return n


@dataclass(frozen=True)
class _Layout:
    """Where a chunk's elements are: ``raw`` (dense storage record) or ``load`` (torch.load the archive)."""

    kind: str
    data_start: int = 0  # file offset of the storage record's first byte
    record_size: int = 0
    crc: int = 0
    storage_offset: int = 0
    stride: tuple[int, ...] = ()
    row_major: bool = True


def _row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return all(s <= 1 or st == want for s, st, want in zip(size, stride, strides(size)))


def _archive_layout(storage: Storage, item: _Item, t: _Tensor, chunk: _Chunk, url: str) -> _Layout:
    where = f"{url}: tensor {t.name!r} chunk at offsets {chunk.box.offsets}"
    raw = _ItemFile(storage, item)
    head = bytearray(4)
    if item.length < 4 or raw.readinto(head) != 4 or bytes(head) != _ZIP_MAGIC:
        raise IncompatibleCheckpointError(f"{where} is not a torch.save archive (DCP's safetensors serialization or "
                                          "another writer's layout, which this reader does not read)")
    raw.seek(0)
    buffered = io.BufferedReader(raw, 1 << 16)
    try:
        with zipfile.ZipFile(buffered) as zf:
            names = zf.namelist()
            pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pkls) != 1:
                raise CorruptCheckpointError(f"{where}: the archive has {len(pkls)} data.pkl records")
            prefix = pkls[0][:-len("data.pkl")]
            if prefix + "byteorder" in names and zf.read(prefix + "byteorder") != b"little":
                raise IncompatibleCheckpointError(f"{where} was saved big-endian; only little-endian is read")
            pkl_info = zf.getinfo(pkls[0])
            if pkl_info.file_size > 1 << 20:
                return _Layout("load")
            try:
                desc = _TensorPickle(io.BytesIO(zf.read(pkls[0]))).load()
            except Exception:  # noqa: BLE001 - not the simple shape: torch.load decides
                return _Layout("load")
            if not isinstance(desc, _TensorDesc):
                return _Layout("load")
            rec_name = f"{prefix}data/{desc.storage.key}"
            if rec_name not in names:
                raise CorruptCheckpointError(f"{where}: the archive lacks its storage record {rec_name!r}")
            rec = zf.getinfo(rec_name)
            if rec.compress_type != zipfile.ZIP_STORED or rec.flag_bits & 1:
                return _Layout("load")
            buffered.seek(rec.header_offset)
            local = buffered.read(30)
            if len(local) != 30 or local[:4] != _ZIP_MAGIC:
                raise CorruptCheckpointError(f"{where}: the storage record's zip header is damaged")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data_start = rec.header_offset + 30 + name_len + extra_len
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, struct.error) as e:
        raise CorruptCheckpointError(f"{where}: damaged torch.save archive ({e.__class__.__name__}: {e})") from None
    return _check_desc(desc, rec, data_start, item, t, chunk, where)


def _check_desc(desc: _TensorDesc, rec: zipfile.ZipInfo, data_start: int, item: _Item, t: _Tensor, chunk: _Chunk,
                where: str) -> _Layout:
    size, stride, k = desc.size, desc.stride, t.dtype.itemsize
    if desc.dtype != t.dtype or size != chunk.box.sizes:
        raise CorruptCheckpointError(f"{where}: the archive holds a {desc.dtype} tensor of shape {size}, the metadata "
                                     f"says {t.dtype} {chunk.box.sizes}")
    if not all(type(v) is int and v >= 0 for v in stride + (desc.offset,)) or len(stride) != len(size):
        raise CorruptCheckpointError(f"{where}: the archive has strides {stride} at storage offset {desc.offset}")
    nbytes = desc.storage.numel * desc.storage.dtype.itemsize
    if rec.file_size != nbytes or rec.compress_size != nbytes or nbytes % k:
        raise CorruptCheckpointError(f"{where}: the storage record has {rec.file_size} bytes, its storage needs "
                                     f"{nbytes}")
    if data_start + nbytes > item.length:
        raise CorruptCheckpointError(f"{where}: the storage record ends past the item's {item.length} bytes")
    if math.prod(size):
        last = desc.offset + sum((s - 1) * st for s, st in zip(size, stride))
        if (last + 1) * k > nbytes:
            raise CorruptCheckpointError(f"{where}: the tensor reaches past its storage record")
    return _Layout("raw", item.offset + data_start, nbytes, rec.CRC, desc.offset, stride, _row_major(size, stride))


# --- the reader -----------------------------------------------------------------------------------------------

@dataclass
class _Target:
    tensor: _Tensor
    region: Region
    flat: torch.Tensor


def _admit_bytes_io() -> Any:
    """torch.load(weights_only=True) with ``io.BytesIO`` values admitted (a buffer: constructing it runs nothing)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    return safe_globals([io.BytesIO]) if safe_globals is not None else contextlib.nullcontext()


class DcpReader:
    """A ``CheckpointReader`` over a torch DCP directory (``storage``: local or any fsspec URL).

    ``verify`` (default True): every chunk a read touches is read whole and checked against the CRC-32 its
    ``torch.save`` archive stores; False: only the byte runs requested are read, unchecked.
    """

    def __init__(self, storage: Storage, *, io_threads: int = DEFAULT_IO_THREADS, verify: bool = True):
        self.storage, self.io_threads, self.verify = storage, io_threads, verify
        self.url = storage.url(METADATA_NAME)
        if not storage.exists(METADATA_NAME):
            raise CheckpointNotFoundError(f"{self.url}: no torch DCP checkpoint here (no {METADATA_NAME})")
        self.layout = parse_metadata(storage.read_bytes(METADATA_NAME), self.url)
        self._check_files()
        self._layouts: dict[tuple[str, tuple[int, ...]], _Layout] = {}
        self._tree: Any = None
        self._lock = threading.Lock()

    def _check_files(self) -> None:
        """Every item lies inside its file (one size query per file): a truncated file is caught here."""
        ends: dict[str, tuple[int, str]] = {}
        items = [(c.item, t.name) for t in self.layout.tensors.values() for c in t.chunks] + \
            [(i, name) for name, i in self.layout.values.items()]
        for item, name in items:
            end = item.offset + item.length
            if end > ends.get(item.path, (-1, ""))[0]:
                ends[item.path] = (end, name)
        for path, (end, name) in sorted(ends.items()):
            size = self.storage.file_size(path)
            if size < end:
                raise CorruptCheckpointError(f"{self.storage.url(path)}: data file has {size} bytes, the metadata "
                                             f"places {name!r} up to byte {end} (truncated?)")

    # CheckpointReader

    def tensors(self) -> Mapping[str, TensorInfo]:
        return {name: TensorInfo(name, t.dtype, t.shape, None) for name, t in self.layout.tensors.items()}

    def tree(self) -> Any:
        with self._lock:
            if self._tree is None:
                leaf: dict[str, Any] = {name: TensorRef(name) for name in self.layout.tensors}
                leaf.update((name, self._value(name, item)) for name, item in self.layout.values.items())
                keys = list(self.layout.paths) if self.layout.paths is not None else list(leaf)
                leaf = {k: leaf[k] for k in keys}
                nested = _nest(self.layout.paths, leaf) if self.layout.paths is not None else None
                self._tree = nested if nested is not None else leaf
            return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        targets = [self._target(r) for r in requests]
        groups: dict[tuple[str, tuple[int, ...]], tuple[_Tensor, _Chunk, list]] = {}
        for target in targets:
            if not target.region.numel:
                continue
            t = target.tensor
            for chunk in self._overlapping(t, target.region):
                for piece in intersect(target.region, chunk.box, t.shape):
                    group = groups.setdefault((t.name, chunk.box.offsets), (t, chunk, []))
                    group[2].append((piece, target))
        work = sorted(groups.values(), key=lambda g: -g[1].box.numel)  # biggest first: a short tail
        if not work:
            return
        if len(work) == 1 or self.io_threads <= 1:
            for g in work:
                self._read_chunk(*g)
            return
        with ThreadPoolExecutor(min(self.io_threads, len(work)), thread_name_prefix="shardckpt-dcp") as pool:
            list(pool.map(lambda g: self._read_chunk(*g), work))

    # requests

    def _target(self, request: ReadRequest) -> _Target:
        t = self.layout.tensors.get(request.tensor)
        if t is None:
            raise IncompatibleCheckpointError(f"{self.url}: the checkpoint has no tensor {request.tensor!r}")
        try:
            check_region(request.region, t.shape)
        except ValueError as e:
            raise IncompatibleCheckpointError(f"tensor {request.tensor!r}: {e}") from None
        if request.dest.numel() != request.region.numel or not request.dest.is_contiguous():
            raise ValueError(f"destination for {request.tensor!r} must be contiguous with {request.region.numel} "
                             "elements")
        return _Target(t, request.region, request.dest.detach().reshape(-1))

    @staticmethod
    def _overlapping(t: _Tensor, region: Region) -> Sequence[_Chunk]:
        """The chunks that may overlap ``region``: by bisection where their flat bounds are disjoint."""
        if not t.disjoint:
            return t.live
        lo, hi = flat_bounds(region, t.shape)
        return t.live[bisect.bisect_right(t.ends, lo):bisect.bisect_left(t.starts, hi)]

    # chunks

    def _chunk_layout(self, t: _Tensor, chunk: _Chunk) -> _Layout:
        key = (t.name, chunk.box.offsets)
        layout = self._layouts.get(key)
        if layout is None:
            self._check_transforms(chunk.item, f"tensor {t.name!r}")
            layout = self._layouts[key] = _archive_layout(self.storage, chunk.item, t, chunk,
                                                          self.storage.url(chunk.item.path))
        return layout

    def _check_transforms(self, item: _Item, what: str) -> None:
        if item.transforms:
            raise IncompatibleCheckpointError(
                f"{self.storage.url(item.path)}: {what} is stored through DCP stream transforms "
                f"{list(item.transforms)} (compression or another extension); this reader supports none")

    def _read_chunk(self, t: _Tensor, chunk: _Chunk, pieces: list) -> None:
        layout = self._chunk_layout(t, chunk)
        shape, k = t.shape, t.dtype.itemsize
        whole = self._whole(t, chunk, layout) if self.verify or layout.kind != "raw" or not layout.row_major else None
        for piece, target in pieces:
            if whole is not None:
                src = view_of(whole, strided_view(piece, chunk.box, shape))
            else:
                lo, hi = local_span(piece, chunk.box, shape)
                buf = torch.empty((hi - lo) * k, dtype=torch.uint8)
                self.storage.read_into(chunk.item.path, layout.data_start + (layout.storage_offset + lo) * k,
                                       memoryview(buf.numpy()))
                self._check_bool(t, chunk, buf)
                src = view_of(from_bytes(buf, t.dtype, (hi - lo,)), strided_view(piece, chunk.box, shape, base=lo))
            view_of(target.flat, strided_view(piece, target.region, shape)).copy_(src)

    def _whole(self, t: _Tensor, chunk: _Chunk, layout: _Layout) -> torch.Tensor:
        """The chunk's elements, row-major, as a 1-D tensor (the archive's checksum checked when verifying)."""
        url = self.storage.url(chunk.item.path)
        where = f"{url}: tensor {t.name!r} chunk at offsets {chunk.box.offsets}"
        if layout.kind == "load":
            value = self._load(chunk.item, where, tensor=True)
            if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor or value.dtype != t.dtype or \
                    tuple(value.shape) != chunk.box.sizes:
                raise CorruptCheckpointError(f"{where}: the archive does not hold a {t.dtype} tensor of shape "
                                             f"{chunk.box.sizes}")
            return value.contiguous().reshape(-1)
        buf = torch.empty(layout.record_size, dtype=torch.uint8)
        self.storage.read_into(chunk.item.path, layout.data_start, memoryview(buf.numpy()))
        if self.verify and zlib.crc32(buf.numpy()) != layout.crc:
            raise CorruptCheckpointError(f"{where} fails its CRC-32 (stored {layout.crc:08x}, read "
                                         f"{zlib.crc32(buf.numpy()):08x})")
        k, numel = t.dtype.itemsize, chunk.box.numel
        if layout.row_major:
            data = buf[layout.storage_offset * k:(layout.storage_offset + numel) * k]
            self._check_bool(t, chunk, data)
            return from_bytes(data, t.dtype, (numel,))
        self._check_bool(t, chunk, buf)
        store = from_bytes(buf, t.dtype, (layout.record_size // k,))
        return store.as_strided(chunk.box.sizes, layout.stride, layout.storage_offset).contiguous().reshape(-1)

    def _check_bool(self, t: _Tensor, chunk: _Chunk, data: torch.Tensor) -> None:
        if t.dtype == torch.bool and data.numel() and int(data.max()) > 1:
            raise CorruptCheckpointError(f"{self.storage.url(chunk.item.path)}: tensor {t.name!r} chunk at offsets "
                                         f"{chunk.box.offsets} holds a bool byte other than 0 or 1")

    def _load(self, item: _Item, where: str, tensor: bool) -> Any:
        """``torch.load(weights_only=True)`` of a whole item (``io.BytesIO`` admitted for values)."""
        data = bytearray(item.length)
        self.storage.read_into(item.path, item.offset, memoryview(data))
        if self.verify:
            try:
                bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
            except (zipfile.BadZipFile, EOFError, ValueError) as e:
                raise CorruptCheckpointError(f"{where}: damaged torch.save archive ({e})") from None
            if bad is not None:
                raise CorruptCheckpointError(f"{where}: record {bad!r} of its torch.save archive fails its CRC-32")
        try:
            if tensor:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            with _admit_bytes_io():
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise IncompatibleCheckpointError(f"{where}: torch.load(weights_only=True) refuses it, and shardckpt "
                                              f"unpickles nothing else: {str(e).splitlines()[0]}") from None
        except Exception as e:  # noqa: BLE001 - a damaged archive
            raise CorruptCheckpointError(f"{where}: unreadable torch.save archive ({e.__class__.__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def _value(self, name: str, item: _Item) -> Any:
        self._check_transforms(item, f"value {name!r}")
        where = f"{self.storage.url(item.path)}: value {name!r}"
        head = bytearray(min(4, item.length))
        self.storage.read_into(item.path, item.offset, memoryview(head))
        if bytes(head) != _ZIP_MAGIC:
            raise CorruptCheckpointError(f"{where} is not a torch.save archive")
        return self._load(item, where, tensor=False)
