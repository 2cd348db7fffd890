"""When an incremental save may reference a stored chunk instead of writing it, and how it cuts tensors into
chunks so that unchanged bytes line up from save to save (docs/design/incremental.md). Pure: no I/O.

A format v5 reader finds a chunk's bytes by its key, (tensor name, chunk number), in the index of the file the
manifest names for it, and returns that row's bytes decoded as the manifest's dtype. So a save may name an
existing pool file for chunk ``key`` only if the row stored under ``key`` in that file decodes to exactly the
bytes this save would have written for ``key``:

1. the row is the one the reader will find: same file, same key (``StoredChunk`` comes from the parent's
   manifest and that file's index, both read whole and checked);
2. its logical length is the new chunk's;
3. its bytes decode the same under the new dtype: ``raw`` and ``zstd`` always, ``zstd-planes`` only for the
   item size it was split with (the planes are the dtype's bytes);
4. its keyed digest equals the digest of the new chunk's bytes, both under this pool's key.

1-3 are exact checks; 4 fails for distinct bytes with probability 2^-128 (``format.content_hash``). Nothing
else (the region, the shape, the dtype itself, a version counter) is needed or trusted.
"""
from __future__ import annotations

from dataclasses import dataclass

ZSTD_PLANES = "zstd-planes"  # format.codecs.ZSTD_PLANES (not imported: that module loads zstandard)
REUSE, NO_ROW, OTHER_POOL, NO_DIGEST, LENGTH, PLANES, DIGEST = (
    "reuse", "no stored row", "another pool", "stored row has no digest", "length differs",
    "planes split for another item size", "digest differs")


@dataclass(frozen=True)
class ChunkKey:
    """How a reader finds a chunk's row in its file's index."""

    name: str
    chunk: int


@dataclass(frozen=True)
class StoredChunk:
    """A row of a pool file's index, as the parent checkpoint places it: ``file`` is the data file's path in the pool
    (``data-<generation>/rank-00000-0.bin``), ``itemsize`` the item size of the dtype it was written under."""

    key: ChunkKey
    pool_id: str
    file: str
    length: int
    codec: str
    itemsize: int
    digest: bytes | None


@dataclass(frozen=True)
class NewChunk:
    """A chunk this save would write: its key, its bytes' length and digest, its dtype's item size."""

    key: ChunkKey
    pool_id: str
    length: int
    itemsize: int
    digest: bytes


def decodes_alike(codec: str, stored_itemsize: int, new_itemsize: int) -> bool:
    """Whether a row stored with ``codec`` under a dtype of ``stored_itemsize`` decodes to the same bytes when read
    as a dtype of ``new_itemsize`` (``zstd-planes`` splits by item size; every other codec is bytes only)."""
    return codec != ZSTD_PLANES or stored_itemsize == new_itemsize


def reuse_decision(stored: StoredChunk | None, new: NewChunk) -> str:
    """``REUSE`` if the save may name ``stored.file`` for ``new.key`` instead of writing the chunk, else why not
    (one of the constants above). The rules are the module docstring's 1-4, in that order."""
    if stored is None or stored.key != new.key:
        return NO_ROW
    if stored.pool_id != new.pool_id:
        return OTHER_POOL
    if stored.digest is None:
        return NO_DIGEST
    if stored.length != new.length:
        return LENGTH
    if not decodes_alike(stored.codec, stored.itemsize, new.itemsize):
        return PLANES
    if stored.digest != new.digest:
        return DIGEST
    return REUSE


def unit_bounds(start: int, stop: int, unit: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut at the multiples of ``unit`` (global coordinates: elements of a flat range, or rows of
    a box's first dim). Cut where the tensor's coordinates say, not where a rank's shard starts, so that after a
    reshard every unit that lies inside both the old and the new shard is the same unit, with the same bytes."""
    if unit < 1 or start < 0 or stop < start:
        raise ValueError(f"unit_bounds({start}, {stop}, {unit}): need 0 <= start <= stop and unit >= 1")
    cuts = [start] + list(range((start // unit + 1) * unit, stop, unit)) + [stop]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def unit_length(itemsize: int, unit_bytes: int, row_elements: int = 1) -> int:
    """Units of at most ``unit_bytes`` (at least one row of ``row_elements`` elements), in elements or rows."""
    if itemsize < 1 or unit_bytes < 1 or row_elements < 1:
        raise ValueError("itemsize, unit_bytes and row_elements must be >= 1")
    return max(1, unit_bytes // (itemsize * row_elements))
