"""The content hash that decides whether an incremental save may reference a chunk instead of writing it
(docs/design/incremental.md, "How identical is established").

A chunk's hash is keyed BLAKE3 over its logical bytes (the bytes its CRC32C covers), truncated to 128 bits:

    key    = BLAKE3-derive_key(CONTEXT, pool secret)      (32 bytes; the secret is 32 random bytes per pool)
    digest = BLAKE3-keyed(key, chunk bytes)[:16]

Why keyed and why BLAKE3: two chunks are compared only pairwise (a chunk of this save against the row its parent
stored under the same tensor name and chunk number), and which pair is compared never depends on the key (the
training process does not read it). For a keyed pseudo-random function, a fixed pair of distinct byte strings
then collides with probability 2^-128 plus the PRF's advantage: that is the whole proof that a changed chunk is
never taken for an unchanged one. CRC32C is linear (colliding pairs are built by algebra), and xxh3-128 has fixed
pairs that collide with probability ~2^-27 over a random seed or secret (xxHash issue #1127), so neither can be the
evidence. No I/O here; the ``blake3`` package is imported on first use, with an install hint.
"""
from __future__ import annotations

import re
import secrets
from typing import Any

from shardckpt.errors import CheckpointError, CorruptCheckpointError

ALGORITHM = "blake3-128-keyed"  # recorded in the pool's pool.json; a pool is hashed one way for its whole life
CONTEXT = "shardckpt pool chunk content v1"  # BLAKE3 derive_key context: this key is used for nothing else
SECRET_BYTES = 32
DIGEST_BYTES = 16
_HEX = re.compile(r"^[0-9a-f]{32}$")


class HashUnavailableError(CheckpointError, ImportError):
    """Incremental saves need the ``blake3`` package, which is not installed (reads never need it).
    (To move into ``shardckpt.errors`` with the implementation.)"""


def _blake3() -> Any:
    try:
        import blake3
    except ImportError as e:
        raise HashUnavailableError("incremental saves hash chunks with BLAKE3: pip install 'shardckpt[incremental]' "
                                   "(or blake3); loading an incremental checkpoint does not need it") from e
    return blake3


def new_secret() -> bytes:
    """A fresh pool secret (written once into pool.json when the pool is created)."""
    return secrets.token_bytes(SECRET_BYTES)


def chunk_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key of chunk hashes, derived from the pool's secret (domain separation: a later use of
    the secret derives its own key under another context)."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
        raise CorruptCheckpointError(f"a pool secret is {SECRET_BYTES} bytes, got {secret!r:.40}")
    return _blake3().blake3(bytes(secret), derive_key_context=CONTEXT).digest()


class ChunkHasher:
    """A chunk's digest fed block by block, as a writer thread streams the chunk (the same blocks it CRCs and
    writes). The GIL is released for large blocks, so writer threads hash in parallel."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError(f"a chunk key is 32 bytes (chunk_key), got {len(key)}")
        self._h = _blake3().blake3(key=key)
        self.length = 0

    def update(self, data: Any) -> None:
        """``data``: any contiguous bytes-like object; it is read as bytes (a uint8 view), whatever its type."""
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
        self._h.update(view)
        self.length += len(view)

    def digest(self) -> bytes:
        return self._h.digest(length=DIGEST_BYTES)


def chunk_hash(key: bytes, data: Any) -> bytes:
    """The digest of one chunk's bytes in one call."""
    hasher = ChunkHasher(key)
    hasher.update(data)
    return hasher.digest()


def to_hex(digest: bytes) -> str:
    """How an index row stores a digest: 32 lowercase hex digits."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a chunk digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    return digest.hex()


def from_hex(text: Any, where: str) -> bytes:
    """A digest read from an index row (untrusted): exactly 32 lowercase hex digits."""
    if not isinstance(text, str) or not _HEX.match(text):
        raise CorruptCheckpointError(f"{where}: a chunk hash is 32 lowercase hex digits, got {text!r:.80}")
    return bytes.fromhex(text)
