"""How a chunk's bytes are stored: the codec registry, and the encoding of one frame (FORMAT.md, "Codecs").

A chunk is split into frames of ``block_size`` logical bytes, the same spans as its checksum blocks, and
each frame is encoded on its own, so that a partial read decodes only the frames it overlaps:

- ``raw``: the chunk's bytes as they are (no frame table).
- ``zstd``: each frame is one zstd frame of the frame's bytes (integers, bool, 1-byte floats).
- ``zstd-planes``: each frame's ``n`` elements of itemsize ``k`` are first split into ``k`` byte planes
  (all elements' byte 0, then all byte 1, ...), then zstd. Writers use it for floating-point and complex
  data of itemsize > 1: the exponent bytes of trained weights compress well and the low mantissa bytes do
  not, and mixed they hide each other.

A frame whose encoding would not be smaller is stored as it is; its stored length then equals its logical
length, which is how a reader tells (an encoded frame is always strictly smaller). Checksums are always of
the logical bytes, so they do not depend on the codec.

Encoding and decoding run on one process-wide pool of threads (zstandard releases the GIL).
"""
from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from shardckpt.errors import CorruptCheckpointError

RAW, ZSTD, ZSTD_PLANES = "raw", "zstd", "zstd-planes"
CODECS = (RAW, ZSTD, ZSTD_PLANES)
DEFAULT_LEVEL = 1
MIN_LEVEL, MAX_LEVEL = -7, 22
# The cores this process may run on (not the machine's: affinity and cpusets), capped: more threads than
# that only add frames in flight (2 per thread per data file being written).
CODEC_THREADS = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                           16))
# No zstd frame decodes to more than this many times its size: each block of at most 128 KiB of output takes
# at least 4 stored bytes (an RLE block). It bounds what a compressed checkpoint's files can back.
MAX_RATIO = 1 << 15


class FrameError(ValueError):
    """A stored frame that does not decode to exactly its logical bytes."""


def codec_named(name: object, where: str) -> str:
    if not (isinstance(name, str) and name in CODECS):
        raise CorruptCheckpointError(f"{where}: unknown codec {str(name)[:40]!r} (this version reads "
                                     f"{', '.join(CODECS)})")
    return name


@dataclass(frozen=True)
class Compression:
    """A save's ``compress`` option: zstd at ``level``, with byte planes for floating-point data."""

    level: int = DEFAULT_LEVEL

    @classmethod
    def parse(cls, spec: object) -> Compression | None:
        """``None``/``"none"`` (store raw), ``"zstd"`` (level 1) or ``"zstd:LEVEL"`` (-7..22), or a ``Compression``."""
        if spec is None:
            return None
        if isinstance(spec, Compression):
            spec = str(spec)  # checked like its text
        if isinstance(spec, str):
            if spec == "none":
                return None
            m = re.fullmatch(r"zstd(?::(-?\d{1,3}))?", spec)
            level = int(m.group(1)) if m and m.group(1) else DEFAULT_LEVEL
            if m and MIN_LEVEL <= level <= MAX_LEVEL and level != 0:  # zstd's level 0 means "its default"
                return cls(level)
        raise ValueError(f"compress must be None, 'none', 'zstd' or 'zstd:LEVEL' with LEVEL in {MIN_LEVEL}..-1 or "
                         f"1..{MAX_LEVEL}, got {spec!r}")

    def __str__(self) -> str:
        return f"zstd:{self.level}"

    def codec_for(self, dtype: torch.dtype) -> str:
        floating = dtype.is_floating_point or dtype.is_complex
        return ZSTD_PLANES if floating and dtype.itemsize > 1 else ZSTD


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor (they are not thread-safe). At the fast levels a small hash table and
    7-byte minimum matches are ~1.8x faster on byte planes of trained weights, and no larger
    (benchmarks/bench_compress.py)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        tuned = {"hash_log": 6, "min_match": 7} if level <= 1 else {}
        params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, **tuned)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _split_planes(frame: memoryview, k: int) -> np.ndarray:
    elements = np.frombuffer(frame, np.uint8).reshape(-1, k)
    planes = np.empty((k, len(elements)), np.uint8)
    for j in range(k):  # one strided pass per plane: ~10x faster than a transposing copy of the whole array
        planes[j] = elements[:, j]
    return planes


def _join_planes(planes: bytes, k: int, out: memoryview) -> None:
    elements = np.frombuffer(out, np.uint8).reshape(-1, k)
    split = np.frombuffer(planes, np.uint8).reshape(k, -1)
    for j in range(k):
        elements[:, j] = split[j]


def encode_frame(codec: str, frame: memoryview, itemsize: int, level: int) -> memoryview:
    """The stored form of one frame: its encoding if that is smaller, else the frame itself."""
    data = _split_planes(frame, itemsize) if codec == ZSTD_PLANES else frame
    encoded = _compressor(level).compress(data)
    return memoryview(encoded) if len(encoded) < len(frame) else frame


def decode_frame(codec: str, stored: memoryview, itemsize: int, out: memoryview) -> None:
    """Decode one stored frame into ``out`` (exactly its logical length). Raises ``FrameError`` for a frame
    that is damaged or would decode to any other size: the output is bounded before anything is allocated."""
    n = len(out)
    if len(stored) == n:  # stored as it is
        out[:] = stored
        return
    try:
        claimed = zstandard.frame_content_size(stored)
        if claimed != n:
            raise FrameError(f"claims {claimed} decoded bytes, its frame holds {n}")
        data = _decompressor().decompress(stored, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(f"does not decode ({e})") from None
    if len(data) != n:
        raise FrameError(f"decodes to {len(data)} bytes, its frame holds {n}")
    if codec == ZSTD_PLANES:
        _join_planes(data, itemsize, out)
    else:
        out[:] = data


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def codec_pool() -> ThreadPoolExecutor:
    """The process-wide pool that encodes and decodes frames, one thread per core. Its tasks never wait on
    other tasks, so callers on other pools may wait on it without deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="shardckpt-codec")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child inherits the pool object but not its threads: submitting to it would wait forever."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
