"""A DCP checkpoint's ``.metadata``: unpickled through a closed allow-list, then validated into ``DcpLayout``.

The file is a pickled ``torch.distributed.checkpoint.metadata.Metadata``. ``state_dict_metadata`` maps each
flattened key (the dotted path, e.g. ``model.layers.0.weight``, ``optim.state.layers.0.weight.exp_avg``) to a
``TensorStorageMetadata`` (dtype, global size, chunks as ``offsets``/``sizes`` boxes) or a
``BytesStorageMetadata`` (any other value); ``storage_data`` maps ``MetadataIndex(fqn, chunk offsets)`` to
``_StorageInfo(relative_path, offset, length, transform_descriptors)``; ``planner_data`` maps each flattened key
to its path in the nested state dict.

**The metadata is never unpickled with pickle's defaults.** ``_MetadataUnpickler.find_class`` admits
exactly the globals torch 2.13's ``.metadata`` references (``ADMITTED_GLOBALS``; found by unpickling
real FSDP1 and FSDP2 checkpoints with a recording ``find_class``): DCP's metadata classes, ``torch.Size``,
torch dtypes, the layout helper, the memory-format enum and ``pathlib`` paths. Each but ``torch.Size`` and
the dtype objects maps to an inert stand-in defined here (records that take only their fields, layout names
and paths kept as strings), so no DCP or pathlib code runs while unpickling, nothing unpickled is ever
called, and this package needs no ``torch.distributed`` import. Any other global
raises ``CorruptCheckpointError`` naming the file and the global. The result is then validated: types,
non-negative shapes, chunks inside their tensor and tiling it exactly, dtypes within ``format.dtypes``, strided
layouts, plain relative file paths, list indices in ``planner_data`` bounded by the file's bytes (an index
costs a slot for every one below it). (That every item lies inside its file is the reader's check at open.)
"""
from __future__ import annotations

import io
import math
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.tree import MAX_DEPTH
from shardckpt.format.validate import MAX_NUMEL
from shardckpt.formats.untrusted import shown
from shardckpt.regions import Box, check_region, check_tiling, flat_bounds

METADATA_NAME = ".metadata"
_SUPPORTED_DTYPES = frozenset(DTYPES.values())


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
        raise ValueError(f"unknown memory-format code {shown(code)}")
    return code


def _layout(name: Any) -> str:
    """``torch.serialization._get_layout(name)``: kept as its name (only ``torch.strided`` is read)."""
    if not isinstance(name, str):
        raise ValueError(f"layout name {shown(name)} is not a string")
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
    # and ("torch", <name>) for every torch dtype object (torch.float32, torch.bfloat16, ...): TORCH_DTYPES
}
TORCH_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str):
        super().__init__(io.BytesIO(data))
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        admitted = ADMITTED_GLOBALS.get((module, name))
        if admitted is None and module == "torch":
            admitted = TORCH_DTYPES.get(name)
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
class Item:
    """One stored item: a tensor chunk's or a bytes entry's ``torch.save`` archive in a data file."""

    path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class Chunk:
    box: Box
    item: Item


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]  # as stored
    live: tuple[Chunk, ...]  # the non-empty ones, by their flat bounds
    starts: tuple[int, ...]  # live chunks' flat bounds
    ends: tuple[int, ...]
    disjoint: bool  # the live chunks' flat bounds do not overlap (dim-0 shards): bisect on them


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and 0 <= v <= MAX_NUMEL for v in value):
        raise ValueError(f"{what} {shown(value)} is not a sequence of non-negative ints up to {MAX_NUMEL}")
    if math.prod(max(v, 1) for v in value) > MAX_NUMEL:  # a 0 beside absurd sizes still has no storage
        raise ValueError(f"{what} {shown(value)} is absurdly large")
    return tuple(value)


_SAFE_PATH = re.compile(r"^[^/\\:]+(/[^/\\:]+)*$")


def _item(info: Any, what: str) -> Item:
    if not isinstance(info, _StorageInfo):
        raise ValueError(f"{what} has storage info of type {type(info).__name__} (not DCP's FileSystemWriter layout; "
                         "safetensors or another storage writer?)")
    path, offset, length = _attr(info, "relative_path"), _attr(info, "offset"), _attr(info, "length")
    if not isinstance(path, str) or not _SAFE_PATH.match(path) or any(p in (".", "..") for p in path.split("/")):
        raise ValueError(f"{what} names the file {shown(path)}, not a plain relative path")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise ValueError(f"{what} has byte range offset={shown(offset)} length={shown(length)}")
    transforms = _attr(info, "transform_descriptors")
    if transforms is None:
        transforms = ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise ValueError(f"{what} has transform descriptors {shown(transforms)}")
    return Item(path, offset, length, tuple(transforms))


def _entry_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    if not isinstance(index, _MetadataIndex) or not isinstance(_attr(index, "fqn"), str):
        raise ValueError(f"storage_data has a key of type {type(index).__name__}, not a MetadataIndex")
    fqn, offset = _attr(index, "fqn"), _attr(index, "offset")
    return fqn, None if offset is None else _ints(offset, f"storage key {fqn!r} offset")


def _tensor(name: str, meta: Any, items: dict, url: str) -> StoredTensor:
    props = _attr(meta, "properties")
    if not isinstance(props, _TensorProperties):
        raise ValueError("no TensorProperties")
    dtype = _attr(props, "dtype")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {shown(dtype)}")
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
        chunks.append(Chunk(box, item))
    try:
        check_tiling([c.box for c in chunks], shape)
    except ValueError as e:
        raise ValueError(f"the chunks do not tile shape {shape}: {e}") from None
    live = sorted((c for c in chunks if c.box.numel), key=lambda c: flat_bounds(c.box, shape))
    bounds = [flat_bounds(c.box, shape) for c in live]
    disjoint = all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:]))
    return StoredTensor(name, dtype, shape, tuple(chunks), tuple(live), tuple(b[0] for b in bounds),
                        tuple(b[1] for b in bounds), disjoint)


@dataclass(frozen=True)
class DcpLayout:
    """The validated metadata: tensors and bytes entries by key, the nesting paths, the DCP version."""

    tensors: dict[str, StoredTensor]
    values: dict[str, Item]  # bytes entries
    paths: dict[str, tuple] | None  # key -> path in the nested state dict (planner_data), when consistent
    version: str | None
    files: tuple[str, ...]


def parse_metadata(data: bytes, url: str) -> DcpLayout:
    """Unpickle (closed allow-list) and validate a ``.metadata`` file; ``url`` names it in errors."""
    md = _unpickle_metadata(data, url)
    try:
        return _validate(md, url, len(data))
    except ValueError as e:
        raise CorruptCheckpointError(f"{url}: {e}") from None


def _validate(md: _Metadata, url: str, size: int) -> DcpLayout:
    version = _attr(md, "version")
    if version is not None and (not isinstance(version, str) or not version.startswith("1.")):
        raise IncompatibleCheckpointError(f"{url}: written by DCP metadata version {shown(version)}; this reader knows 1.x")
    sdm, sd = _attr(md, "state_dict_metadata"), _attr(md, "storage_data")
    if not isinstance(sdm, dict) or not all(isinstance(k, str) for k in sdm):
        raise ValueError("state_dict_metadata is not a dict by key")
    if not isinstance(sd, dict):
        raise ValueError(f"storage_data is a {type(sd).__name__}, not a dict (not DCP's FileSystemWriter layout)")
    items: dict[tuple[str, tuple[int, ...] | None], Item] = {}
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
    return DcpLayout(tensors, values, _paths(_attr(md, "planner_data"), list(sdm), size), version, tuple(files))


def _paths(planner_data: Any, keys: list[str], slots: int) -> dict[str, tuple] | None:
    """DCP's default planner's key -> nested path map, if it is one and agrees with the keys; else None. The lists
    the paths describe (an int component is an index) may hold ``slots`` slots in all: an index costs a slot for
    every index below it, so an index is bounded by the bytes that name it, not taken at its word."""
    if not isinstance(planner_data, dict) or set(planner_data) != set(keys):
        return None
    for key, path in planner_data.items():
        if not isinstance(path, tuple) or not 0 < len(path) <= MAX_DEPTH or \
                not all(type(p) is str or (type(p) is int and p >= 0) for p in path) or \
                ".".join(map(str, path)) != key:
            return None
    lengths: dict[tuple, int] = {}  # a list's path -> its length (its greatest index + 1)
    total = 0
    for key, path in planner_data.items():
        for i, part in enumerate(path):
            if type(part) is int and part >= lengths.get(path[:i], 0):
                total += part + 1 - lengths.get(path[:i], 0)
                lengths[path[:i]] = part + 1
                if total > slots:
                    raise ValueError(f"planner_data places {key[:200]!r} at list index {part}: the lists it "
                                     f"describes would hold more than {slots} slots, one per byte of the metadata")
    return {k: planner_data[k] for k in keys}
