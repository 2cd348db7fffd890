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
the digests do (3.2: many writes do not bump it), or, for a unit whose pages the kernel saw unwritten since that
save's window read them (``checkpoint.write_tracker``), the digest recorded then, without reading the unit.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.write_tracker import Mark, WriteTracker, write_tracker
from shardckpt.format.content_hash import chunk_hash
from shardckpt.regions import flat_bounds
from shardckpt.tensor_views import host_memory

Bounds = tuple[int, int]  # a unit's global row-major element range [lo, hi)
INLINE_BYTES = 4 << 20  # a piece this small is hashed in the caller's thread (threads cost more than they save)


def version_hint(t: torch.Tensor) -> tuple:
    """What moves when ``t`` is written through torch (or replaced): compared only to skip a hash, never to skip
    a copy."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), t._version)


@dataclass(frozen=True)
class Recorded:
    """One piece at a committed save: its version hint in that save's window, its units' digests, and the write
    tracker's mark taken in that window before anything read the piece (None: not tracked)."""

    hint: tuple
    units: dict[Bounds, bytes]
    mark: Mark | None = None


@dataclass(frozen=True)
class WindowDigests:
    """This rank's digests of its last committed incremental save, ``step`` of run directory ``run``, under the
    pool key ``key``, for saves into the same run directory with the same ``unit_bytes``. The save that uses them
    asks for ``step`` as its parent: the rows the digests were taken from."""

    key: bytes
    unit_bytes: int
    run: str
    step: str
    pieces: dict[str, Recorded]


@dataclass(frozen=True)
class Prehashed:
    """What the background is told of the pieces left unstaged: each unit's window digest, under ``key``."""

    key: bytes
    digests: dict[str, dict[Bounds, bytes]]


@dataclass
class WindowHasher:
    """One save's window: ``skip(piece)`` hashes a piece that may be unchanged and says whether to leave it
    unstaged; every CPU piece's version hint and write-tracker mark are kept (``hints``, ``marks``) for the next
    save. ``prehashed()`` ends the window (its hashing threads)."""

    previous: WindowDigests | None
    hints: dict[str, tuple] = field(default_factory=dict)
    marks: dict[str, Mark | None] = field(default_factory=dict)
    digests: dict[str, dict[Bounds, bytes]] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None
    _tracker: WriteTracker | None = field(default_factory=write_tracker)
    _read: dict[str, torch.Tensor] = field(default_factory=dict)  # the pieces marked, until the window ends

    def __post_init__(self) -> None:
        if self._tracker is not None:
            self._tracker.begin()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(2, torch.get_num_threads()), thread_name_prefix="shardckpt-window")
        return self._pool

    def skip(self, piece: LocalPiece) -> bool:
        t = piece.data
        if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
            return False
        hint = self.hints[piece.name] = version_hint(t)
        # before the piece is hashed or staged: what this window reads of it holds its value at the mark
        self.marks[piece.name] = self._tracker.protect(t) if self._tracker is not None else None
        self._read[piece.name] = t
        recorded = self.previous.pieces.get(piece.name) if self.previous is not None else None
        if recorded is None or recorded.hint != hint or not _tiles(recorded.units, piece):
            return False
        start, size = flat_bounds(piece.region, piece.shape)[0], t.element_size()

        def unwritten(bounds: Bounds) -> bool:
            return self._tracker is not None and self._tracker.unwritten(
                recorded.mark, t, (bounds[0] - start) * size, (bounds[1] - start) * size)

        digests = _hash_units(self.previous.key, t, start, recorded.units, self._threads, unwritten)
        if digests is None:
            return False
        self.digests[piece.name] = digests
        return True

    def prehashed(self) -> Prehashed | None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for name, t in self._read.items():  # every piece is staged or hashed by now
            self.marks[name] = WriteTracker.confirmed(self.marks[name], t)
        self._read.clear()
        return Prehashed(self.previous.key, self.digests) if self.digests else None

    @property
    def parent(self) -> str | None:
        """The checkpoint the background should reference (the one the window compared against), if any."""
        return self.previous.step if self.previous is not None else None

    def committed(self, key: bytes, unit_bytes: int, path: str, units: dict[str, dict[Bounds, bytes]]) -> WindowDigests:
        """The digests for the next save, once this one (at ``path``) committed: ``units``, this rank's units as the
        background wrote or referenced them, of the pieces whose hint was taken here."""
        pieces = {name: Recorded(self.hints[name], by, self.marks.get(name)) for name, by in units.items()
                  if name in self.hints}
        run, step = split_step(path)
        return WindowDigests(key, unit_bytes, run, step, pieces)


def split_step(path: str) -> tuple[str, str]:
    """A checkpoint's path as (its run directory, its name there)."""
    run, _, step = path.rstrip("/").rpartition("/")
    return run, step


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


def _hash_units(key: bytes, t: torch.Tensor, start: int, units: dict[Bounds, bytes],
                threads: Callable[[], ThreadPoolExecutor],
                unwritten: Callable[[Bounds], bool]) -> dict[Bounds, bytes] | None:
    """Each unit's digest, or None at the first that differs from ``units`` (the units not begun are not hashed:
    a piece written without a bump is then copied after as little hashing as the threads allow). A unit the
    write tracker saw unwritten since its digest was taken is not read."""
    raw, size = host_memory(t), t.element_size()

    def one(bounds: Bounds) -> bytes:
        return chunk_hash(key, raw[(bounds[0] - start) * size:(bounds[1] - start) * size])

    order = [b for b in units if not unwritten(b)]
    if len(order) <= 1 or t.nbytes <= INLINE_BYTES:
        for bounds in order:
            if one(bounds) != units[bounds]:
                return None
        return dict(units)
    futures = [threads().submit(one, b) for b in order]
    for bounds, future in zip(order, futures):
        if future.result() != units[bounds]:
            for f in futures:
                f.cancel()
            return None
    return dict(units)
