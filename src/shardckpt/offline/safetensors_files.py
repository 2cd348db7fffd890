"""The files of a safetensors export: headers computed before any data, each file streamed tensor by tensor
from the source in bounded slices, and the file operations the export's commit and resume need (``export``
has the what, ``export_commit`` the when; this module the bytes). The tensors are ``export``'s output tensors: name, source
name, source and output dtypes, shape, ``nbytes``."""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Mapping, Sequence

from shardckpt.checkpoint.writer import StreamedPiece
from shardckpt.formats.safetensors_header import DTYPE_NAMES, INDEX_NAME, METADATA_KEY
from shardckpt.io import FileWriter, LocalStorage, Storage
from shardckpt.tensor_views import as_bytes

SINGLE_FILE = "model.safetensors"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def header_bytes(tensors: Sequence, metadata: dict[str, str]) -> bytes:
    """The 8-byte little-endian header length and the JSON header, padded with spaces to a multiple of 8."""
    obj: dict[str, Any] = {METADATA_KEY: metadata}
    offset = 0
    for t in tensors:
        obj[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(storage: Storage, path: str, header: bytes, tensors: Sequence,
               pieces: Mapping[str, StreamedPiece]) -> None:
    """Write file ``path`` whole and close it (durable on local disk; the upload completes elsewhere): the header,
    then each tensor's bytes as its piece streams them (``offline.streams.ReadOnDemand``: slices of the source,
    cast)."""
    writer = storage.open_writer(path)
    try:
        writer.write(memoryview(header))
        for t in tensors:
            for part in pieces[t.name].slices(t.dtype.itemsize, 0):
                writer.write(memoryview(as_bytes(part).numpy()))
    except BaseException:
        abandon(writer)
        raise
    writer.close()


def abandon(writer: FileWriter) -> None:
    """Drop a file being written without completing it: an object store's upload is aborted, not completed
    (fsspec files complete their upload when closed, even by the garbage collector)."""
    file = getattr(writer, "_file", None)
    if file is None:
        try:
            writer.close()  # local disk: the descriptor; the file is removed by the caller
        except OSError:
            pass
        return
    try:
        discard = getattr(file, "discard", None)
        if callable(discard):
            discard()
        file.closed = True
    except Exception:  # noqa: BLE001 - best effort: the caller removes the file
        pass


def rename(storage: Storage, old: str, new: str) -> None:
    """Local disk only (the commit): rename ``old`` over ``new``."""
    os.replace(storage.url(old), storage.url(new))


def remove(storage: Storage, name: str) -> None:
    """Delete the file ``name``, if it is there."""
    if isinstance(storage, LocalStorage):
        try:
            os.unlink(storage.url(name))
        except FileNotFoundError:
            pass
    else:
        storage.remove_dir(name)  # on an object store, a key and anything under it


def is_written(storage: Storage, name: str, header: bytes, members: Sequence) -> bool:
    """Whether file ``name`` is the one this export would write: its size and its header (names, dtypes,
    shapes, offsets, the source's identity) as planned. A file only ever has its name once it is whole."""
    if storage.file_size(name) != len(header) + sum(t.nbytes for t in members):
        return False
    head = bytearray(len(header))
    storage.read_into(name, 0, memoryview(head))
    return bytes(head) == header


def existing_export(storage: Storage) -> list[str]:
    """The export files at ``storage`` (the index first)."""
    names = storage.list_files()
    return sorted((n for n in names if n in (SINGLE_FILE, INDEX_NAME) or _SHARD_RE.fullmatch(n)),
                  key=lambda n: (n != INDEX_NAME, n))
