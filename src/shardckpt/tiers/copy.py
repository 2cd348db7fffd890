"""Moving one checkpoint file between tiers, checked: a replica is received under ``<name>.part-<token>``, checked
block by block against its index (itself checked against the manifest) and only then renamed; an upload checks
the source copy as it reads it. Every copy of a file therefore matched the one manifest when it was made."""
from __future__ import annotations

import dataclasses
import os
import uuid

import numpy as np

from shardckpt.format.manifest import FileEntry, Manifest
from shardckpt.format.dtypes import itemsize
from shardckpt.formats.native.frames import StoredChunk, read_span
from shardckpt.formats.native.reader import read_index
from shardckpt.io import LocalStorage, Storage

PIECE = 16 << 20  # bytes per ranged read of a file being copied


def check_file(storage: Storage, manifest: Manifest, file: FileEntry) -> None:
    """Raise ``CorruptCheckpointError`` unless ``file`` at ``storage`` matches the manifest: its size, its index's
    size and CRC32C, and every checksum block of every chunk its index lists."""
    index = read_index(storage, file, manifest.version)
    where = storage.url(file.path)
    buf = np.empty(0, np.uint8)
    for (name, i), rec in sorted(index.items(), key=lambda kv: kv[1].offset):
        step = max(PIECE // rec.block_size, 1) * rec.block_size
        # the tensor's item size: a byte-plane compressed chunk decodes to its logical bytes only with it
        chunk = StoredChunk(storage, file.path, rec, itemsize(manifest.tensors[name].dtype), True,
                            f"{where}: tensor {name!r} chunk {i}")
        for lo in range(0, rec.length, step):
            hi = min(lo + step, rec.length)
            if buf.nbytes < hi - lo:
                buf = np.empty(hi - lo, np.uint8)
            read_span(chunk, lo, hi, [buf[:hi - lo]])


def stream(src: Storage, dst: Storage, path: str, size: int, dst_path: str | None = None) -> None:
    """Copy ``path``'s ``size`` bytes from ``src`` to ``dst`` (at ``dst_path``), ``PIECE`` at a time."""
    buf = bytearray(min(PIECE, max(size, 1)))
    writer = dst.open_writer(dst_path or path)
    try:
        for lo in range(0, size, PIECE):
            view = memoryview(buf)[:min(PIECE, size - lo)]
            src.read_into(path, lo, view)
            writer.write(view)
    except BaseException:
        writer.close()
        raise
    writer.close()


def receive(src: Storage, dst: LocalStorage, manifest: Manifest, file: FileEntry) -> int:
    """A replica of ``file`` from ``src`` (a peer) into ``dst`` (this node's step directory): index and data under
    ``.part-`` names, checked, then renamed (index first: a data file under its name has its index). Returns the
    bytes received. A copy that fails its checks is removed and raises ``CorruptCheckpointError``."""
    token = uuid.uuid4().hex[:12]
    part = dataclasses.replace(file, path=f"{file.path}.part-{token}", index_path=f"{file.index_path}.part-{token}")
    try:
        stream(src, dst, file.index_path, file.index_size, part.index_path)
        stream(src, dst, file.path, file.size, part.path)
        check_file(dst, manifest, part)
        os.replace(dst.url(part.index_path), dst.url(file.index_path))
        os.replace(dst.url(part.path), dst.url(file.path))
    finally:
        for p in (part.path, part.index_path):
            try:
                os.unlink(dst.url(p))
            except FileNotFoundError:
                pass
    return file.size + file.index_size


def upload(src: Storage, dst: Storage, manifest: Manifest, file: FileEntry) -> int:
    """``file`` from this node's tier 0 to tier 2: checked at the source first (a damaged tier-0 copy is never
    uploaded), then streamed, index last. Returns the bytes uploaded."""
    check_file(src, manifest, file)
    stream(src, dst, file.path, file.size)
    stream(src, dst, file.index_path, file.index_size)
    return file.size + file.index_size

