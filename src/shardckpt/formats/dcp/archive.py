"""A stored item's ``torch.save`` archive (a zip, stored uncompressed, inside a ``.distcp`` file): where a
tensor chunk's elements are, reading them, and ``torch.load`` of the archives that are not the simple shape.

**Reads are ranged.** A chunk's archive is opened as a zip through ranged reads (``_ItemFile``: central
directory, ``data.pkl``, the storage record's local header: a few small reads; the reader caches the result per
chunk). Its ``data.pkl`` is interpreted by a closed unpickler (``torch._utils._rebuild_tensor_v2``/``_v3``,
storage types, ``OrderedDict``, dtypes) that only records the storage offset, size and strides
(``ChunkLayout``); then only the byte runs a request needs are read (``read_span``). ``read_whole`` reads a
chunk whole, checked with ``verify`` against the zip's CRC-32 of its storage record, the one checksum DCP keeps.
An archive that is not this simple shape (tensor subclasses, conj/neg bits, compressed records) is loaded whole
with ``torch.load(weights_only=True)``, as is every bytes entry (``load_value``: ``io.BytesIO`` admitted, which
torchtitan's train state used; anything else torch refuses raises ``IncompatibleCheckpointError``).

Refused: items stored through stream transforms (``transform_descriptors``: DCP's experimental
compression/extension streams), items that are not zip archives (DCP's safetensors serialization), big-endian
archives.
"""
from __future__ import annotations

import contextlib
import io
import math
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import MAX_DEPTH, depth_exceeds
from shardckpt.formats.dcp.metadata import TORCH_DTYPES, Chunk, Item, StoredTensor
from shardckpt.formats.untrusted import check_expansion
from shardckpt.io import Storage
from shardckpt.regions import strides
from shardckpt.tensor_views import from_bytes

ZIP_MAGIC = b"PK\x03\x04"

# --- data.pkl of a plain tensor: its storage record, offset, size and strides ----------------------------------

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
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
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


# --- where a chunk's elements are ------------------------------------------------------------------------------

class _ItemFile(io.RawIOBase):
    """One item's byte range of a data file as a seekable file, read through ``Storage.read_into``."""

    def __init__(self, storage: Storage, item: Item):
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
class ChunkLayout:
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


def _where(storage: Storage, t: StoredTensor, chunk: Chunk) -> str:
    """A chunk as errors name it."""
    return f"{storage.url(chunk.item.path)}: tensor {t.name!r} chunk at offsets {chunk.box.offsets}"


def _check_transforms(storage: Storage, item: Item, what: str) -> None:
    if item.transforms:
        raise IncompatibleCheckpointError(
            f"{storage.url(item.path)}: {what} is stored through DCP stream transforms "
            f"{list(item.transforms)} (compression or another extension); this reader supports none")


def archive_layout(storage: Storage, t: StoredTensor, chunk: Chunk) -> ChunkLayout:
    """Where ``chunk``'s elements are in its archive (a few small ranged reads)."""
    _check_transforms(storage, chunk.item, f"tensor {t.name!r}")
    where = _where(storage, t, chunk)
    raw = _ItemFile(storage, chunk.item)
    head = bytearray(4)
    if chunk.item.length < 4 or raw.readinto(head) != 4 or bytes(head) != ZIP_MAGIC:
        raise IncompatibleCheckpointError(f"{where} is not a torch.save archive (DCP's safetensors serialization or "
                                          "another writer's layout, which this reader does not read)")
    raw.seek(0)
    buffered = io.BufferedReader(raw, 1 << 16)
    try:
        with zipfile.ZipFile(buffered) as zf:
            found = _storage_record(zf, where)
            if found is None:
                return ChunkLayout("load")
            desc, rec = found
            data_start = _data_start(buffered, rec, where)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, struct.error) as e:
        raise CorruptCheckpointError(f"{where}: damaged torch.save archive ({e.__class__.__name__}: {e})") from None
    return _check_desc(desc, rec, data_start, t, chunk, where)


def _data_pkl(zf: zipfile.ZipFile, where: str) -> str:
    """The archive's one ``data.pkl`` record (its name); a big-endian archive is refused."""
    names = zf.namelist()
    pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkls) != 1:
        raise CorruptCheckpointError(f"{where}: the archive has {len(pkls)} data.pkl records")
    prefix = pkls[0][:-len("data.pkl")]
    if prefix + "byteorder" in names and zf.read(prefix + "byteorder") != b"little":
        raise IncompatibleCheckpointError(f"{where} was saved big-endian; only little-endian is read")
    return pkls[0]


def _storage_record(zf: zipfile.ZipFile, where: str) -> tuple[_TensorDesc, zipfile.ZipInfo] | None:
    """The tensor ``data.pkl`` describes and its stored storage record; None where torch.load must decide."""
    pkl = _data_pkl(zf, where)
    if zf.getinfo(pkl).file_size > 1 << 20:
        return None
    try:
        desc = _TensorPickle(io.BytesIO(zf.read(pkl))).load()
    except Exception:  # noqa: BLE001 - not the simple shape: torch.load decides
        return None
    if not isinstance(desc, _TensorDesc):
        return None
    rec_name = f"{pkl[:-len('data.pkl')]}data/{desc.storage.key}"
    if rec_name not in zf.namelist():
        raise CorruptCheckpointError(f"{where}: the archive lacks its storage record {rec_name!r}")
    rec = zf.getinfo(rec_name)
    if rec.compress_type != zipfile.ZIP_STORED or rec.flag_bits & 1:
        return None
    return desc, rec


def _data_start(buffered: io.BufferedReader, rec: zipfile.ZipInfo, where: str) -> int:
    """The item offset of ``rec``'s first data byte, past its local header."""
    buffered.seek(rec.header_offset)
    local = buffered.read(30)
    if len(local) != 30 or local[:4] != ZIP_MAGIC:
        raise CorruptCheckpointError(f"{where}: the storage record's zip header is damaged")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return rec.header_offset + 30 + name_len + extra_len


def _check_desc(desc: _TensorDesc, rec: zipfile.ZipInfo, data_start: int, t: StoredTensor, chunk: Chunk,
                where: str) -> ChunkLayout:
    size, stride, k, item = desc.size, desc.stride, t.dtype.itemsize, chunk.item
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
    return ChunkLayout("raw", item.offset + data_start, nbytes, rec.CRC, desc.offset, stride, _row_major(size, stride))


# --- reading: a span of a raw record, a whole chunk, a whole archive -------------------------------------------

def read_span(storage: Storage, t: StoredTensor, chunk: Chunk, layout: ChunkLayout, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a ``raw``, row-major chunk as a 1-D tensor (only those bytes read; no CRC-32 check)."""
    k = t.dtype.itemsize
    buf = torch.empty((hi - lo) * k, dtype=torch.uint8)
    storage.read_into(chunk.item.path, layout.data_start + (layout.storage_offset + lo) * k, memoryview(buf.numpy()))
    _check_bool(storage, t, chunk, buf)
    return from_bytes(buf, t.dtype, (hi - lo,))


def read_whole(storage: Storage, t: StoredTensor, chunk: Chunk, layout: ChunkLayout, verify: bool) -> torch.Tensor:
    """The chunk's elements, row-major, as a 1-D tensor (the archive's checksum checked when verifying)."""
    where = _where(storage, t, chunk)
    if layout.kind == "load":
        value = _load(storage, chunk.item, where, tensor=True, verify=verify)
        if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor or value.dtype != t.dtype or \
                tuple(value.shape) != chunk.box.sizes:
            raise CorruptCheckpointError(f"{where}: the archive does not hold a {t.dtype} tensor of shape "
                                         f"{chunk.box.sizes}")
        return value.contiguous().reshape(-1)
    buf = torch.empty(layout.record_size, dtype=torch.uint8)
    storage.read_into(chunk.item.path, layout.data_start, memoryview(buf.numpy()))
    if verify and zlib.crc32(buf.numpy()) != layout.crc:
        raise CorruptCheckpointError(f"{where} fails its CRC-32 (stored {layout.crc:08x}, read "
                                     f"{zlib.crc32(buf.numpy()):08x})")
    k, numel = t.dtype.itemsize, chunk.box.numel
    if layout.row_major:
        data = buf[layout.storage_offset * k:(layout.storage_offset + numel) * k]
        _check_bool(storage, t, chunk, data)
        return from_bytes(data, t.dtype, (numel,))
    _check_bool(storage, t, chunk, buf)
    store = from_bytes(buf, t.dtype, (layout.record_size // k,))
    return store.as_strided(chunk.box.sizes, layout.stride, layout.storage_offset).contiguous().reshape(-1)


def _check_bool(storage: Storage, t: StoredTensor, chunk: Chunk, data: torch.Tensor) -> None:
    if t.dtype == torch.bool and data.numel() and int(data.max()) > 1:
        raise CorruptCheckpointError(f"{_where(storage, t, chunk)} holds a bool byte other than 0 or 1")


def load_value(storage: Storage, name: str, item: Item, verify: bool) -> Any:
    """A bytes entry: its archive loaded with ``torch.load(weights_only=True)``, ``io.BytesIO`` admitted."""
    _check_transforms(storage, item, f"value {name!r}")
    where = f"{storage.url(item.path)}: value {name!r}"
    head = bytearray(min(4, item.length))
    storage.read_into(item.path, item.offset, memoryview(head))
    if bytes(head) != ZIP_MAGIC:
        raise CorruptCheckpointError(f"{where} is not a torch.save archive")
    value = _load(storage, item, where, tensor=False, verify=verify)
    check_expansion(value, item.length, where)  # a value is part of the tree: bounded by its bytes, and shallow
    if depth_exceeds(value):
        raise CorruptCheckpointError(f"{where} nests more than {MAX_DEPTH} levels deep")
    return value


def _admit_bytes_io() -> Any:
    """torch.load(weights_only=True) with ``io.BytesIO`` values admitted (a buffer: constructing it runs nothing)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    return safe_globals([io.BytesIO]) if safe_globals is not None else contextlib.nullcontext()


def _load(storage: Storage, item: Item, where: str, tensor: bool, verify: bool) -> Any:
    """``torch.load(weights_only=True)`` of a whole item (``io.BytesIO`` admitted for values)."""
    data = bytearray(item.length)
    storage.read_into(item.path, item.offset, memoryview(data))
    if verify:
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
