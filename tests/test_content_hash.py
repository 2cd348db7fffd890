"""The keyed content hash of incremental checkpoints (format/content_hash.py) and the rule that decides whether a
save may reference a stored chunk (format/chunk_identity.py), adversarially: bytes that differ where a weak check
cannot see it (a CRC32C collision, one flipped bit, the same bytes under another key), and every field of the rule."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.format import content_hash as ch
from shardckpt.format.checksum import crc32c
from shardckpt.format.chunk_identity import (
    DIGEST, LENGTH, NO_DIGEST, NO_ROW, OTHER_POOL, PLANES, REUSE, ZSTD_PLANES, ChunkKey, NewChunk, StoredChunk,
    decodes_alike, reuse_decision,
)

KEY = ch.chunk_key(bytes(range(32)))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.lists(st.integers(0, 5000), max_size=6))
def test_streaming_in_any_blocks_equals_one_call(data, cuts):
    hasher = ch.ChunkHasher(KEY)
    bounds = [0] + sorted(c for c in cuts if c <= len(data)) + [len(data)]
    for a, b in zip(bounds, bounds[1:]):
        hasher.update(data[a:b])
    assert hasher.digest() == ch.chunk_hash(KEY, data)
    assert hasher.length == len(data)
    assert len(hasher.digest()) == ch.DIGEST_BYTES


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_one_flipped_bit_changes_the_digest(data, draw):
    bit = draw.draw(st.integers(0, 8 * len(data) - 1))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert ch.chunk_hash(KEY, bytes(flipped)) != ch.chunk_hash(KEY, data)


def test_a_prefix_or_an_extension_has_another_digest():
    data = bytes(1000)
    assert len({ch.chunk_hash(KEY, data[:n]) for n in (0, 1, 999, 1000)} | {ch.chunk_hash(KEY, data + b"\0")}) == 5


def test_the_key_matters_and_is_derived_from_the_secret():
    a, b = ch.chunk_key(bytes(32)), ch.chunk_key(bytes(31) + b"\1")
    assert a != b and len(a) == 32 and a != bytes(32)  # derived, not the secret itself
    assert ch.chunk_hash(a, b"x" * 100) != ch.chunk_hash(b, b"x" * 100)
    assert len(ch.new_secret()) == ch.SECRET_BYTES and ch.new_secret() != ch.new_secret()
    with pytest.raises(ch.CorruptCheckpointError):
        ch.chunk_key(bytes(16))


def test_typed_buffers_hash_as_their_bytes():
    arr = np.arange(1000, dtype=np.float32)
    assert ch.chunk_hash(KEY, arr) == ch.chunk_hash(KEY, arr.tobytes())
    assert ch.chunk_hash(KEY, arr.reshape(10, 100)) == ch.chunk_hash(KEY, arr.tobytes())


def _crc_collision(n: int) -> tuple[bytes, bytes]:
    """Two distinct ``n``-byte strings with the same CRC32C: CRC is affine over GF(2), so any non-zero ``d`` with
    crc(d) == crc(zeros) gives crc(x ^ d) == crc(x). Gaussian elimination over the 8n unit vectors finds one."""
    zero = crc32c(bytes(n))
    rows = []  # (image, combination as an int over bits)
    for bit in range(8 * n):
        unit = bytearray(n)
        unit[bit // 8] = 1 << (bit % 8)
        image, combo = crc32c(bytes(unit)) ^ zero, 1 << bit
        for r_image, r_combo in rows:
            if image ^ r_image < image:
                image, combo = image ^ r_image, combo ^ r_combo
        if image == 0:
            d = combo.to_bytes(n, "little")
            x = bytes((i * 37 + 11) % 256 for i in range(n))
            return x, bytes(a ^ b for a, b in zip(x, d))
        rows.append((image, combo))
        rows.sort(reverse=True)
    raise AssertionError("no kernel vector: n too small")


def _stored(**kw) -> StoredChunk:
    base = dict(key=ChunkKey("w", 0), pool_id="p", file="data-a/rank-00000-0.bin", length=64, codec="raw",
                itemsize=4, digest=None)
    return StoredChunk(**{**base, **kw})


def test_a_crc32c_collision_is_not_taken_for_unchanged():
    old, new = _crc_collision(64)
    assert old != new and crc32c(old) == crc32c(new)
    stored = _stored(digest=ch.chunk_hash(KEY, old))
    assert reuse_decision(stored, NewChunk(ChunkKey("w", 0), "p", 64, 4, ch.chunk_hash(KEY, new))) == DIGEST
    assert reuse_decision(stored, NewChunk(ChunkKey("w", 0), "p", 64, 4, ch.chunk_hash(KEY, old))) == REUSE


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["name", "chunk", "pool", "digest", "length", "itemsize", "none", "no-digest"]),
       st.sampled_from(["raw", "zstd", ZSTD_PLANES]))
def test_reuse_only_when_every_condition_holds(change, codec):
    digest = ch.chunk_hash(KEY, b"\1" * 64)
    stored = _stored(codec=codec, digest=digest)
    new = dict(key=ChunkKey("w", 0), pool_id="p", length=64, itemsize=4, digest=digest)
    assert reuse_decision(stored, NewChunk(**new)) == REUSE
    expected = {"name": NO_ROW, "chunk": NO_ROW, "pool": OTHER_POOL, "digest": DIGEST, "length": LENGTH,
                "none": NO_ROW, "no-digest": NO_DIGEST,
                "itemsize": PLANES if codec == ZSTD_PLANES else REUSE}[change]
    changed = {"name": dict(key=ChunkKey("v", 0)), "chunk": dict(key=ChunkKey("w", 1)), "pool": dict(pool_id="q"),
               "digest": dict(digest=ch.chunk_hash(KEY, b"\2" * 64)), "length": dict(length=32),
               "itemsize": dict(itemsize=2)}.get(change, {})
    row = None if change == "none" else _stored(codec=codec, digest=None) if change == "no-digest" else stored
    assert reuse_decision(row, NewChunk(**{**new, **changed})) == expected


def test_the_same_bytes_under_another_dtype_decode_alike_unless_split_in_planes():
    assert decodes_alike("raw", 4, 2) and decodes_alike("zstd", 4, 1) and decodes_alike(ZSTD_PLANES, 2, 2)
    assert not decodes_alike(ZSTD_PLANES, 4, 2)


def test_digests_round_trip_as_hex_and_bad_hex_is_corrupt():
    digest = ch.chunk_hash(KEY, b"abc")
    assert ch.from_hex(ch.to_hex(digest), "x") == digest
    for bad in ("", "A" * 32, "0" * 31, "g" * 32, 5, None, "0" * 33):
        with pytest.raises(ch.CorruptCheckpointError, match="x: a chunk hash"):
            ch.from_hex(bad, "x")


def test_without_blake3_an_incremental_save_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(ch.HashUnavailableError, match=r"shardckpt\[incremental\]"):
        ch.chunk_key(bytes(32))
