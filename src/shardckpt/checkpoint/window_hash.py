"""What an incremental ``async_save`` may leave unstaged (docs/design/incremental.md, 5.2).

The checkpoint holds the values at the instant ``async_save`` returns, so what is skipped must be known equal *at
that instant*. A CPU piece that this rank wrote or referenced, whole, at its previous committed save is hashed in
the blocked window instead of copied, unit by unit as that save cut it: if every digest equals the one recorded
then, the piece is not staged (its staged data is the caller's tensor, which the background reads only to recopy,
below), and its window digests go to the background (``Prehashed``).

The background references a prehashed unit only if its candidate row passes ``format.chunk_identity`` against the
window digest, exactly as for a staged unit. If it cannot (another parent, a collector removed the row, the
generation was consolidated away, another pool), it copies the unit from the caller's tensor and writes that copy
only if it hashes to the window digest: then it holds the value at the instant. Else the save fails and commits
nothing, and the saver forgets its digests, so that the next save stages everything.

The version counter only decides whether hashing is worth it: a piece whose counter (or storage, offset, dtype,
shape, strides) moved is copied at once, as it has most likely changed. It never decides that a piece is unchanged:
the digests do (3.2: many writes do not bump it).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.format.content_hash import chunk_hash
from shardckpt.regions import flat_bounds
from shardckpt.tensor_views import as_bytes

Bounds = tuple[int, int]  # a unit's global row-major element range [lo, hi)


def version_hint(t: torch.Tensor) -> tuple:
    """What moves when ``t`` is written through torch (or replaced): compared only to skip a hash, never to skip
    a copy."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), t._version)


@dataclass(frozen=True)
class Recorded:
    """One piece at a committed save: its version hint in that save's window, and its units' digests."""

    hint: tuple
    units: dict[Bounds, bytes]


@dataclass(frozen=True)
class WindowDigests:
    """This rank's digests of its last committed incremental save, under the pool key ``key``, for saves into
    the same run directory (``run``) with the same ``unit_bytes``."""

    key: bytes
    unit_bytes: int
    run: str
    pieces: dict[str, Recorded]


@dataclass(frozen=True)
class Prehashed:
    """What the background is told of the pieces left unstaged: each unit's window digest, under ``key``."""

    key: bytes
    digests: dict[str, dict[Bounds, bytes]]


@dataclass
class WindowHasher:
    """One save's window: ``skip(piece)`` hashes a piece that may be unchanged and says whether to leave it
    unstaged; every CPU piece's version hint is kept (``hints``) for the next save."""

    previous: WindowDigests | None
    hints: dict[str, tuple] = field(default_factory=dict)
    digests: dict[str, dict[Bounds, bytes]] = field(default_factory=dict)

    def skip(self, piece: LocalPiece) -> bool:
        t = piece.data
        if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
            return False
        hint = self.hints[piece.name] = version_hint(t)
        recorded = self.previous.pieces.get(piece.name) if self.previous is not None else None
        if recorded is None or recorded.hint != hint or not _tiles(recorded.units, piece):
            return False
        digests = _hash_units(self.previous.key, t, flat_bounds(piece.region, piece.shape)[0], recorded.units)
        if digests is None:
            return False
        self.digests[piece.name] = digests
        return True

    def prehashed(self) -> Prehashed | None:
        return Prehashed(self.previous.key, self.digests) if self.digests else None

    def committed(self, key: bytes, unit_bytes: int, run: str, units: dict[str, dict[Bounds, bytes]]) -> WindowDigests:
        """The digests for the next save, once this one committed: ``units``, this rank's units as the background
        wrote or referenced them, of the pieces whose hint was taken here."""
        pieces = {name: Recorded(self.hints[name], by) for name, by in units.items() if name in self.hints}
        return WindowDigests(key, unit_bytes, run, pieces)


def _tiles(units: dict[Bounds, bytes], piece: LocalPiece) -> bool:
    """Whether ``units`` cut exactly the piece's region, which is one run (so that each unit is a slice of it)."""
    lo, hi = flat_bounds(piece.region, piece.shape)
    if hi - lo != piece.data.numel():
        return False
    at = lo
    for start, stop in sorted(units):
        if start != at or stop <= start:
            return False
        at = stop
    return at == hi


def _hash_units(key: bytes, t: torch.Tensor, start: int, units: dict[Bounds, bytes]) -> dict[Bounds, bytes] | None:
    """Each unit's digest, or None at the first that differs from ``units`` (the units not begun are not hashed:
    a piece written without a bump is then copied after as little hashing as the threads allow)."""
    raw, size = as_bytes(t).numpy(), t.element_size()

    def one(bounds: Bounds) -> bytes:
        return chunk_hash(key, raw[(bounds[0] - start) * size:(bounds[1] - start) * size])

    order = list(units)
    if len(order) <= 1:
        digests = {b: one(b) for b in order}
        return digests if digests == units else None
    with ThreadPoolExecutor(_threads(), thread_name_prefix="shardckpt-window-hash") as threads:
        futures = [threads.submit(one, b) for b in order]
        for bounds, future in zip(order, futures):
            if future.result() != units[bounds]:
                for f in futures:
                    f.cancel()
                return None
    return dict(zip(order, (f.result() for f in futures)))


def _threads() -> int:
    """As many as torch's own copies use (they are what the hash replaces), at least two."""
    return max(2, torch.get_num_threads())
