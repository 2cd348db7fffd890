"""``describe``: what a checkpoint holds, opened as a load opens it (``checkpoint.lane.open_checkpoint``).
shardckpt's own format from its manifest (and its chunk indexes, for the block size and the stored form); the
other formats ``formats.detect.open_reader`` reads from their reader's listing."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardckpt.checkpoint.lane import open_checkpoint
from shardckpt.dist.group import LOCAL
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format.codecs import RAW
from shardckpt.format.dtypes import dtype_name
from shardckpt.format.manifest import COMPRESSED_VERSION, FORMAT_NAME, MANIFEST_NAME, chunks_of
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import NativeReader
from shardckpt.formats.native.pool import files_view, pool_storage
from shardckpt.formats.native.reader import read_index
from shardckpt.io import DEFAULT_IO_THREADS, Storage, open_storage, where


def format_description(reader: CheckpointReader, storage: Storage) -> tuple[str, int | None]:
    """The format as a person reads it, e.g. ``"safetensors (Hugging Face directory, 3 files)"``, and the
    number of files it spans where the reader says (``storage``: the checkpoint's path as a directory)."""
    name = reader.facts().format
    if name == "safetensors":
        files = len(getattr(reader, "headers", None) or ()) or None
        if storage.is_dir():
            return f"{name} (Hugging Face directory, {_count(files, 'file')})", files
        return name, files
    if name == "torch DCP":
        files = getattr(getattr(reader, "layout", None), "files", None)
        files = len(files) if files is not None else None
        return (f"{name} ({_count(files, 'data file')})" if files is not None else name), files
    if name == "torch.save":
        return name, 1
    return name, None


def _count(n: int | None, what: str) -> str:
    return f"{n if n is not None else '?'} {what}{'' if n == 1 else 's'}"


def foreign_format(place: str | os.PathLike | Storage) -> str | None:
    """The description of the format at ``place`` (a local path, or the place opened) when it holds a checkpoint
    of a format other than shardckpt's own; ``None`` when it holds shardckpt's format or nothing recognised. A
    committed manifest says shardckpt's format without being read: a damaged one is for ``verify`` to report."""
    storage = open_storage(place)
    if storage.exists(MANIFEST_NAME):
        return None
    try:
        reader = open_reader(storage, verify=False)
    except CheckpointNotFoundError:
        return None
    return None if reader.facts().format == FORMAT_NAME else format_description(reader, storage)[0]


def describe(place: str | os.PathLike | Storage) -> dict:
    """A JSON-able summary: format, world size, state-dict type, total (logical) and stored bytes, and one
    entry per tensor, with its stored bytes and codecs (from every chunk index in format v3, which may
    compress; before it every chunk is ``raw``, stored as its bytes).

    ``block_size`` is the checksum block size of the first data file's chunks (format v2 on; ``None`` for
    v1, whose partial reads are checked by reading whole chunks). Another format (see ``describe_reader``)
    has ``format``, ``description``, ``files``, ``total_bytes``, ``tensors`` and ``values`` only."""
    pinned = open_checkpoint(place, process_group=LOCAL, verify=False)
    if not isinstance(pinned.reader, NativeReader):  # what a reader lists; shardckpt's own says more
        return describe_reader(pinned.reader, where(place), pinned.storage)
    manifest = pinned.reader.manifest
    storage = files_view(pinned.storage, manifest)  # a pooled (v5) checkpoint's files are its pool's
    block_size, stored = None, _StoredForm(manifest.version)
    # A pool file's index also lists other checkpoints' chunks: count only those this manifest places there.
    placed = _placed(manifest) if manifest.pool is not None else None
    if manifest.version >= 2 and manifest.files:
        # Format v3 may compress: every index says how each chunk is stored. Before v3 all are raw.
        files = range(len(manifest.files)) if manifest.version >= COMPRESSED_VERSION else [0]
        with ThreadPoolExecutor(DEFAULT_IO_THREADS) as pool:
            for f, records in zip(files, pool.map(lambda f: _index_or_none(storage, manifest, f), files)):
                if records is None:
                    stored.damaged.add(f)
                    continue
                if placed is not None:
                    records = {key: rec for key, rec in records.items() if key in placed[f]}
                block_size = block_size or next((r.block_size for r in records.values()), None)
                stored.add(records)
    tensors = [{"name": t.name, "dtype": dtype_name(t.dtype, t.name), "shape": list(t.shape), "bytes": t.nbytes,
                **stored.of(t), "chunks": len(t.chunks), "crc32c": f"{t.crc32c:08x}"}
               for t in manifest.tensors.values()]
    return {
        "path": where(place),
        "format": FORMAT_NAME,
        "version": manifest.version,
        "manifest_checksum": manifest.checksummed,
        "block_size": block_size,
        "created_by": manifest.created_by,
        "world_size": manifest.world_size,
        "state_dict_type": manifest.metadata.get("state_dict_type"),
        "total_bytes": manifest.total_bytes,
        "stored_bytes": _stored_bytes(manifest, stored),
        "files": len(manifest.files),
        "metadata": manifest.metadata,
        "tensors": tensors,
        "pool": None if manifest.pool is None else {
            "path": where(pool_storage(pinned.storage)), "id": manifest.pool["id"],
            "generations": len({f.path.split("/", 1)[0] for f in manifest.files})},
    }


def _placed(manifest) -> dict[int, set]:
    """Per file of ``manifest``, the (tensor, chunk) rows it places there."""
    placed: dict[int, set] = {f: set() for f in range(len(manifest.files))}
    for entry in manifest.tensors.values():
        for i, _, f in chunks_of(entry):
            placed[f].add((entry.name, i))
    return placed


def _stored_bytes(manifest, stored: _StoredForm) -> int | None:
    """The data files' bytes (alignment padding included); a pooled checkpoint's: its own chunks' stored bytes in
    the pool's shared files (None if an index could not be read)."""
    if manifest.pool is None:
        return sum(f.size for f in manifest.files)
    return None if stored.damaged else sum(stored.bytes.values())


def _index_or_none(storage: Storage, manifest, f: int) -> dict | None:
    """A data file's chunk index, or None if it (or its data file) is damaged: ``verify`` says what is wrong."""
    try:
        return read_index(storage, manifest.files[f], manifest.version)
    except CorruptCheckpointError:
        return None


class _StoredForm:
    """Per tensor: the stored bytes of its chunks and their codecs, from chunk indexes (None for a tensor
    with chunks in a damaged file)."""

    def __init__(self, version: int):
        self.version = version
        self.bytes: dict[str, int] = {}
        self.codecs: dict[str, set[str]] = {}
        self.damaged: set[int] = set()  # the files whose index could not be read: their tensors' stored form unknown

    def add(self, records: dict) -> None:
        for (name, _), rec in records.items():
            self.bytes[name] = self.bytes.get(name, 0) + rec.stored_length
            self.codecs.setdefault(name, set()).add(rec.codec)

    def of(self, entry) -> dict:
        if self.version < COMPRESSED_VERSION:  # every chunk raw: stored as its bytes
            return {"stored_bytes": entry.nbytes, "codecs": [RAW] if len(entry.chunks) else []}
        if entry.chunks.files_used() & self.damaged:
            return {"stored_bytes": None, "codecs": None}
        return {"stored_bytes": self.bytes.get(entry.name, 0), "codecs": sorted(self.codecs.get(entry.name, ()))}


def describe_reader(reader: CheckpointReader, path: str | os.PathLike, storage: Storage) -> dict:
    """The summary of a checkpoint of another format: its name, its tensors by name (dtype, shape, bytes, the
    checksum where the format keeps one, else ``None``), the total, and the dotted names of its plain values
    (each tensor-free subtree once, e.g. ``optim.param_groups``)."""
    description, files = format_description(reader, storage)
    tensors = []
    for t in reader.tensors().values():
        nbytes = t.dtype.itemsize
        for d in t.shape:
            nbytes *= d
        tensors.append({"name": t.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "bytes": nbytes, "crc32c": None if t.crc32c is None else f"{t.crc32c:08x}"})
    values = [path_name(p) for p, leaf in leaves(reader.tree(), _is_ref) if not isinstance(leaf, TensorRef)]
    return {
        "path": where(path),
        "format": reader.facts().format,
        "description": description,
        "files": files,
        "total_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "values": values,
    }


def _is_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)
