"""``describe``: what a checkpoint holds, from its manifest alone (no data is read)."""
from __future__ import annotations

import os

from shardckpt.checkpoint.load import read_manifest
from shardckpt.storage.backend import open_storage
from shardckpt.storage.dtypes import dtype_name
from shardckpt.storage.manifest import FORMAT_NAME, FORMAT_VERSION


def describe(path: str | os.PathLike, *, storage_options: dict | None = None) -> dict:
    """A JSON-able summary: format, world size, state-dict type, total bytes, and one entry per tensor."""
    manifest = read_manifest(open_storage(path, storage_options))
    tensors = [{"name": t.name, "dtype": dtype_name(t.dtype, t.name), "shape": list(t.shape), "bytes": t.nbytes,
                "chunks": len(t.chunks), "crc32c": f"{t.crc32c:08x}"} for t in manifest.tensors.values()]
    return {
        "path": os.fspath(path),
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_by": manifest.created_by,
        "world_size": manifest.world_size,
        "state_dict_type": manifest.metadata.get("state_dict_type"),
        "total_bytes": manifest.total_bytes,
        "files": len(manifest.files),
        "metadata": manifest.metadata,
        "tensors": tensors,
    }
