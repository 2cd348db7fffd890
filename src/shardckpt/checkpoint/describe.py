"""``describe``: what a checkpoint holds, from its manifest (and the first chunk index, for the block size)."""
from __future__ import annotations

import os

from shardckpt.io import open_storage
from shardckpt.format.dtypes import dtype_name
from shardckpt.format.manifest import FORMAT_NAME
from shardckpt.formats.native import read_manifest
from shardckpt.formats.native.reader import read_index


def describe(path: str | os.PathLike, *, storage_options: dict | None = None) -> dict:
    """A JSON-able summary: format, world size, state-dict type, total bytes, and one entry per tensor.

    ``block_size`` is the checksum block size of the first data file's chunks (format v2 on; ``None`` for
    v1, whose partial reads are checked by reading whole chunks)."""
    storage = open_storage(path, storage_options)
    manifest = read_manifest(storage)
    block_size = None
    if manifest.version >= 2 and manifest.files:
        records = read_index(storage, manifest.files[0], manifest.version)
        block_size = next((r.block_size for r in records.values()), None)
    tensors = [{"name": t.name, "dtype": dtype_name(t.dtype, t.name), "shape": list(t.shape), "bytes": t.nbytes,
                "chunks": len(t.chunks), "crc32c": f"{t.crc32c:08x}"} for t in manifest.tensors.values()]
    return {
        "path": os.fspath(path),
        "format": FORMAT_NAME,
        "version": manifest.version,
        "manifest_checksum": manifest.checksummed,
        "block_size": block_size,
        "created_by": manifest.created_by,
        "world_size": manifest.world_size,
        "state_dict_type": manifest.metadata.get("state_dict_type"),
        "total_bytes": manifest.total_bytes,
        "files": len(manifest.files),
        "metadata": manifest.metadata,
        "tensors": tensors,
    }
