"""Which format a path holds, and its reader: ``open_reader(path)`` for a local path, any fsspec URL, or a
``Storage`` of a checkpoint directory (then only the directory formats are looked for).

The formats are tried in the order of two tables, each row a description (for the error that lists what was
looked for) and a function that returns a reader, or ``None`` when the place does not hold its format:

- ``DIRECTORY_DETECTORS`` look at the path as a directory (or URL prefix): shardckpt's own format
  (``manifest.json``), then a Hugging Face safetensors directory (``model.safetensors.index.json``, or exactly
  one ``*.safetensors`` file that is not a shard of a sharded checkpoint: see ``formats/safetensors.py``), then a torch DCP directory (a ``.metadata`` file; after safetensors, so
  that a Hugging Face directory written by DCP's HF writer is read as the safetensors it is), then a DeepSpeed
  ZeRO checkpoint (``*_optim_states.pt`` files, or a ``latest`` file naming a directory of them; local only,
  as ``torch.save`` files are).
- ``FILE_DETECTORS`` look at the path as one file: a safetensors file (by its ``.safetensors`` name, or by its
  first bytes: an 8-byte header length that fits in the file, then ``{``), then a ``torch.save`` file (the zip
  magic, or a pickle's protocol marker; local files only, see ``formats/torch_save.py``).

A detector that recognises its format but finds it damaged raises (``CorruptCheckpointError`` and kin) rather
than passing the path on: a broken safetensors file is reported as one, not as an unknown format. A missing
path raises ``CheckpointNotFoundError`` ("no such file or directory"); a place that exists but holds nothing
recognised raises it listing the formats looked for.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable

from shardckpt.errors import CheckpointError, CheckpointNotFoundError, IncompatibleCheckpointError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.formats.api import CheckpointReader
from shardckpt.formats.dcp import METADATA_NAME, DcpReader, is_dcp_dir
from shardckpt.formats.deepspeed import DeepSpeedReader, tag_dir
from shardckpt.formats.deepspeed.reader import LATEST, OPTIM_FILE
from shardckpt.formats.native import NativeReader, read_manifest
from shardckpt.formats.safetensors import SafetensorsReader
from shardckpt.formats.safetensors_header import INDEX_NAME, MAX_HEADER_SIZE, SUFFIX
from shardckpt.formats.torch_save import TorchSaveReader, is_torch_save, local_path
from shardckpt.io import DEFAULT_IO_THREADS, FsspecStorage, LocalStorage, Storage, is_named, open_storage, where
from shardckpt.io.navigate import parent
from shardckpt.storage_options import Options

HEAD_BYTES = 16  # what the file detectors see of a file's beginning


@dataclass
class Place:
    """What the detectors look at: ``storage`` (the place, opened once) as a directory and, when it is a file, its
    bytes, read through its parent directory; ``path`` names it in messages.

    Everything is looked up lazily and at most once, so a detector pays only for what it asks.
    """

    path: str
    storage: Storage
    io_threads: int = DEFAULT_IO_THREADS
    verify: bool = True
    _cache: dict = field(default_factory=dict, repr=False)

    def _memo(self, key: str, make: Callable):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def is_dir(self) -> bool:
        return self._memo("is_dir", lambda: self.storage.is_dir())

    @property
    def parent(self) -> tuple[Storage, str]:
        """The storage of the path's directory, and the path's name in it."""
        return self._memo("parent", lambda: parent(self.storage))

    @property
    def file_size(self) -> int | None:
        """The size of the path as a file; None when it is a directory or missing."""
        def make():
            if self.is_dir:
                return None
            try:
                storage, name = self.parent
            except IncompatibleCheckpointError:  # a bucket's root: never a file
                return None
            return storage.file_size(name) if name and storage.exists(name) else None
        return self._memo("file_size", make)

    @property
    def head(self) -> bytes:
        """The file's first ``HEAD_BYTES`` bytes (fewer for a shorter file; none for a directory)."""
        def make():
            size = self.file_size
            if not size:
                return b""
            storage, name = self.parent
            buf = bytearray(min(size, HEAD_BYTES))
            storage.read_into(name, 0, memoryview(buf))
            return bytes(buf)
        return self._memo("head", make)


Detector = Callable[[Place], "CheckpointReader | None"]


def _native(place: Place) -> CheckpointReader | None:
    storage = place.storage
    if not storage.exists(MANIFEST_NAME):
        return None
    return NativeReader(storage, read_manifest(storage), io_threads=place.io_threads, verify=place.verify)


def _safetensors_directory(place: Place) -> CheckpointReader | None:
    storage = place.storage
    if storage.exists(INDEX_NAME):
        return SafetensorsReader.from_directory(storage, io_threads=place.io_threads)
    if not place.is_dir or not any(n.endswith(SUFFIX) for n in storage.list_files()):
        return None
    return SafetensorsReader.from_directory(storage, io_threads=place.io_threads)  # several files: it says so


def _dcp(place: Place) -> CheckpointReader | None:
    if not is_dcp_dir(place.storage):
        return None
    return DcpReader(place.storage, io_threads=place.io_threads, verify=place.verify)


def _deepspeed(place: Place) -> CheckpointReader | None:
    try:
        path = local_path(place.path)
    except CheckpointError:  # a URL: say so if it holds DeepSpeed's files
        names = place.storage.list_files() if place.is_dir else []
        if LATEST in names or any(OPTIM_FILE.match(n) for n in names):
            raise CheckpointError(f"{place.path}: a DeepSpeed checkpoint is read from local disk only (its "
                                  "torch.save files are memory-mapped); copy it to a local directory first") from None
        return None
    return DeepSpeedReader(path) if tag_dir(path) is not None else None


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER_SIZE and 8 + n <= size and head[8:9] == b"{"


def _safetensors_file(place: Place) -> CheckpointReader | None:
    size = place.file_size
    if size is None:
        return None
    storage, name = place.parent
    if not name.endswith(SUFFIX) and not _looks_like_safetensors(place.head, size):
        return None
    return SafetensorsReader.from_file(storage, name, io_threads=place.io_threads)


def _torch_save(place: Place) -> CheckpointReader | None:
    if place.file_size is None or not is_torch_save(place.head):
        return None
    return TorchSaveReader(place.path)  # a URL: it raises, saying to copy the file to local disk


# (what is looked for, the detector), tried in order.
DIRECTORY_DETECTORS: list[tuple[str, Detector]] = [
    (f"shardckpt ({MANIFEST_NAME})", _native),
    (f"safetensors ({INDEX_NAME} or one *{SUFFIX})", _safetensors_directory),
    (f"torch DCP ({METADATA_NAME})", _dcp),
    ("DeepSpeed (*_optim_states.pt)", _deepspeed),
]
FILE_DETECTORS: list[tuple[str, Detector]] = [
    ("safetensors", _safetensors_file),
    ("torch.save", _torch_save),
]


def open_reader(path: str | os.PathLike | Storage, *, storage_options: Options | None = None,
                io_threads: int = DEFAULT_IO_THREADS, verify: bool = True) -> CheckpointReader:
    """The reader for whatever checkpoint ``path`` (a local path, an fsspec URL, or a ``Storage`` of a directory)
    holds.

    ``storage_options`` go to fsspec; ``io_threads`` bounds concurrent reads; ``verify`` (check stored
    checksums) matters for formats that store them (shardckpt's own). Raises ``CheckpointNotFoundError``
    when no format is recognised, and the format's own errors when a recognised one is damaged.
    """
    storage = open_storage(path, storage_options)
    place = Place(os.fspath(path) if is_named(path) else where(path), storage, io_threads, verify)
    files = isinstance(storage, (LocalStorage, FsspecStorage))  # else a caller's Storage: a directory, no parent
    for _, detect in DIRECTORY_DETECTORS + (FILE_DETECTORS if files else []):
        reader = detect(place)
        if reader is not None:
            return reader
    if not place.is_dir and (not files or place.file_size is None):
        raise CheckpointNotFoundError(f"{place.path}: no such file or directory")
    looked = ", ".join(what for what, _ in DIRECTORY_DETECTORS) + " directories" + \
        (("; " + " and ".join(what for what, _ in FILE_DETECTORS) + " files") if files else "")
    raise CheckpointNotFoundError(f"{place.path}: no checkpoint format shardckpt reads. Looked for: {looked}")
