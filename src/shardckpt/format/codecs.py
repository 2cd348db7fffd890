"""How a chunk's bytes are stored: the codec registry. Each index row names its chunk's codec.

Only ``raw`` (the tensor's bytes as they are) exists so far. A compressing codec encodes each checksum
block on its own (a block is a frame), so that a partial read still decodes whole blocks only; its
entry goes here, and readers refuse any name that is not registered.
"""
from __future__ import annotations

from typing import Protocol

from shardckpt.errors import CorruptCheckpointError


class Codec(Protocol):
    name: str  # as written in index rows

    def encode(self, block: memoryview) -> memoryview:
        """The stored form of whole checksum blocks of a chunk's bytes (a compressing codec frames each block)."""


class _Raw:
    name = "raw"

    def encode(self, block: memoryview) -> memoryview:
        return block


RAW: Codec = _Raw()
CODECS: dict[str, Codec] = {RAW.name: RAW}


def codec_named(name: object, where: str) -> Codec:
    codec = CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise CorruptCheckpointError(f"{where}: unknown codec {str(name)[:40]!r} (this version reads "
                                     f"{', '.join(sorted(CODECS))})")
    return codec
