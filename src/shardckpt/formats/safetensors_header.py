"""The safetensors format's untrusted parts, parsed and checked: a file's header and a Hugging Face index.

The header is checked like the reference implementation checks it (and every check names the file, and the
tensor where there is one): the header length is capped (``MAX_HEADER_SIZE``, 100 MB, the reference's limit)
and must fit in the file; the header must be UTF-8 JSON, an object, without duplicate keys or non-finite
constants; every tensor has a known ``dtype``, a ``shape`` of non-negative integers and ``data_offsets``
``[begin, end]`` whose length is the shape's byte size; the tensors tile the data that follows the header
exactly, in any order: no overlap, no hole, no trailing bytes (the format forbids holes, so that a file
cannot be two things at once). ``__metadata__``, if present, maps strings to strings. An index must be a
JSON object whose ``weight_map`` maps tensor names to relative paths inside the directory.
``formats/safetensors.py`` reads through them.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.validate import MAX_NUMEL, absurd_shape
from shardckpt.formats.untrusted import shown
from shardckpt.io import Storage

SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
MAX_HEADER_SIZE = 100_000_000  # bytes; the reference implementation's limit
MAX_INDEX_SIZE = 100_000_000  # bytes of model.safetensors.index.json
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
        if absurd_shape(shape, math.prod(shape)):  # (a 0 beside absurd sizes has no storage, but no layout either)
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
# A file's header


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
