"""Flat reads (``formats.flat``) of tensors stored whole, as one raw chunk of one block (every small tensor a save
writes), straight into the caller's bytes: the chunks close together in one file are read with one ranged read
(a ``Window``; ``reader.close_runs`` groups them, as a load's small chunks), each is checked against its block's
CRC and the manifest's whole-tensor CRC (which is the same), and its wanted elements are copied to the buffer. Anything else (a tensor
of several chunks, a compressed chunk, a bool, a chunk whose bytes do not check) is left to ``read``, which reads
it the general way and names what is wrong."""
from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.checksum import crc32c
from shardckpt.format.chunks import RegularChunks
from shardckpt.format.index import ChunkRecord
from shardckpt.format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from shardckpt.formats.flat import FlatRead
from shardckpt.formats.native.reader import Indexes, Window, close_runs
from shardckpt.io import Storage, lifecycle
from shardckpt.io.local import one_thread_suits

Placed = tuple[int, int, int, ChunkRecord, TensorEntry]  # file, offset in it, position in the reads, record, entry


def read_flat(storage: Storage, manifest: Manifest, indexes: Indexes, reads: Sequence[FlatRead],
              buffer: torch.Tensor, verify: bool, io_threads: int) -> list[int]:
    """Copy the reads of tensors stored whole as one raw block into ``buffer`` (``formats.flat.check_flat_reads``);
    answer the positions of the others. A read of a tensor the checkpoint lacks, or past its end, raises first."""
    wanted, rest = [], []
    for k, r in enumerate(reads):
        entry = manifest.tensors.get(r.tensor)
        if entry is None:
            raise IncompatibleCheckpointError(f"{storage.url(MANIFEST_NAME)}: the checkpoint has no tensor "
                                              f"{r.tensor!r}")
        numel = math.prod(entry.shape)
        if r.region.stop > numel:
            raise IncompatibleCheckpointError(f"tensor {r.tensor!r}: {r.region} exceeds the {numel} elements "
                                              f"of shape {entry.shape}")
        chunks = entry.chunks
        if r.region.numel and entry.dtype == r.dtype and entry.dtype != torch.bool and \
                type(chunks) is RegularChunks and chunks.count == 1:
            wanted.append((k, entry, chunks.file(0), numel * r.dtype.itemsize))
        else:
            rest.append(k)
    if not wanted:
        return rest
    files = {f for _, _, f, _ in wanted}
    pins = lifecycle(storage)
    # Every data file opened first: a concurrent overwrite may delete them once a new manifest is committed.
    pins.pin([manifest.files[f].path for f in sorted(files)])
    try:
        found = indexes.of(files, io_threads)
        placed: list[Placed] = []
        for k, entry, f, nbytes in wanted:
            rec = found[f].get((entry.name, 0))
            if rec is None or rec.frames or len(rec.blocks) != 1 or rec.length != nbytes:
                rest.append(k)
            else:
                placed.append((f, rec.offset, k, rec, entry))
        placed.sort(key=lambda p: (p[0], p[1]))
        runs = close_runs([(f, offset, offset + rec.length) for f, offset, _, rec, _ in placed])
        windows = [[placed[j] for j in run] for run in runs]
        copy = lambda window: _copy_window(storage, manifest, window, reads, buffer.data_ptr(), verify)  # noqa: E731
        if len(windows) > 1 and not one_thread_suits(storage, sum(p[3].length for p in placed)):
            with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardckpt-read") as pool:
                left = list(pool.map(copy, windows))
        else:
            left = [copy(window) for window in windows]
    finally:
        pins.release()
    return rest + [k for ks in left for k in ks]


def _copy_window(storage: Storage, manifest: Manifest, window: list[Placed], reads: Sequence[FlatRead],
                 address: int, verify: bool) -> list[int]:
    """One window read, then each chunk checked and its elements copied; answers the positions of the reads whose
    chunk did not check (``read`` reads them again and reports the failing block)."""
    start = window[0][1]
    data = Window(storage, manifest.files[window[0][0]].path, start,
                  bytearray(max(offset + rec.length for _, offset, _, rec, _ in window) - start))
    bad = []
    for _, offset, k, rec, entry in window:
        at = offset - start
        # (one block: its CRC is the chunk's and, the tensor being this one chunk, the whole tensor's)
        if verify and (rec.blocks[0] != entry.crc32c or crc32c(data.buf[at:at + rec.length]) != rec.blocks[0]):
            bad.append(k)
            continue
        r = reads[k]
        size = entry.dtype.itemsize
        ctypes.memmove(address + r.at, data.address + at + r.region.start * size, r.region.numel * size)
    return bad
