"""A synchronous incremental save's digests of the caller's own memory, kept for the next save into the same pool
(docs/design/incremental.md, 5.3): a unit whose pages the kernel saw unwritten since (``checkpoint.write_tracker``),
in a tensor whose version hint did not move, keeps its digest and is not read again. A unit known then and written
since is written again without being hashed first (the writer hashes what it writes): bytes written back with the
same value (``p.add_(0)``) are then stored again, which costs bytes, never correctness.

A digest is a fact about memory ("these bytes of this storage, read after the mark, hash to this"), not about any
checkpoint: it holds whether or not that save committed, and the reuse rule still compares it with the stored row
as for a digest hashed now. A save that fails forgets what it was told (the next one hashes).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from shardckpt.checkpoint.units import UnitPiece
from shardckpt.checkpoint.window_hash import version_hint
from shardckpt.checkpoint.write_tracker import Mark, WriteTracker, write_tracker

KEEP_POOLS = 4  # pools whose digests one process keeps (a save into another forgets the oldest)
WRITTEN = object()  # recall's answer for a unit known before whose own pages were written since

Span = tuple[int, int]  # bytes [lo, hi) from the piece's data pointer


@dataclass(frozen=True)
class _Piece:
    hint: tuple
    mark: Mark
    digests: dict[Span, bytes]


_by_key: OrderedDict[bytes, dict[str, _Piece]] = OrderedDict()
_lock = threading.Lock()


class _Memory:
    """One save's view: ``recall(unit)`` for each unit before anything reads it, ``unmoved(unit)`` for a unit written
    unhashed, after it was written; then ``learn(units, digests)``."""

    def __init__(self, tracker: WriteTracker | None, staged: Any, previous: dict[str, _Piece]):
        self._tracker, self._staged, self._previous = tracker, staged, previous
        self._marks: dict[str, tuple[tuple, Mark | None]] = {}
        self._ended = False
        self._written: set[tuple[str, Span]] = set()  # units recall answered WRITTEN
        self.learned: dict[str, _Piece] = {}

    def _base(self, unit: UnitPiece) -> torch.Tensor | None:
        """The caller's own tensor the unit is a view of (a synchronous save's CPU piece), or None."""
        staged = self._staged
        if self._tracker is None or unit.name not in staged.aliased or not unit.data.is_contiguous() or \
                (staged.prehashed is not None and unit.name in staged.prehashed.digests):
            return None  # (async_save's window hashed that one: ``window_hash``)
        base = staged.pieces[unit.name].data
        same = base.is_cpu and unit.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        return base if same else None  # (a unit may be a private copy: ``_recopied``)

    def _marked(self, name: str, base: torch.Tensor) -> tuple[tuple, Mark | None]:
        if name not in self._marks:  # before anything reads the piece
            self._marks[name] = (version_hint(base), self._tracker.protect(base))
        return self._marks[name]

    def recall(self, unit: UnitPiece) -> bytes | object | None:
        """The unit's digest if proven unchanged since an earlier save read it; ``WRITTEN`` if the same memory was
        tracked then and is now, and its own pages were written since (an optimizer step: hashing it to compare
        would only find it changed); None if nothing is known (another storage, say: hash it)."""
        base = self._base(unit)
        if base is None:
            return None
        hint, mark = self._marked(unit.name, base)
        old, span = self._previous.get(unit.name), _span(base, unit.data)
        if old is None or span not in old.digests or mark is None:
            return None
        if old.hint == hint and self._tracker.unwritten(old.mark, base, *span):
            return old.digests[span]
        same_memory = old.hint[:-1] == hint[:-1] and not old.mark.storage.expired() and \
            old.mark.cdata == mark.cdata  # the same view of the same storage: only the version may differ
        # Only a write seen on the unit's own pages says "written": pages shared with other memory are written by
        # others too, and a moved version counter is the whole tensor's (one row of an embedding changed).
        if not same_memory or not self._tracker.written_own_pages(old.mark, base, *span):
            return None
        self._written.add((unit.name, span))
        return WRITTEN

    def unmoved(self, unit: UnitPiece) -> bool:
        """Whether a unit written unhashed was not written by anyone while this save read it."""
        base = self._base(unit)
        span = _span(base, unit.data) if base is not None else None
        if (unit.name, span) not in self._written:
            return False
        if not self._ended:
            self._tracker.begin()  # stamps what was written since the marks
            self._ended = True
        # written, not discarded: the pages this save's writer read were zero pages if they were zapped before
        return self._tracker.unwritten(self._marks[unit.name][1], base, *span, discards=False)

    def learn(self, units: list[UnitPiece], digests: list[bytes | None]) -> None:
        """Keep each unit's digest, once the save read all it needed (the marks' edge bytes confirmed)."""
        confirmed: dict[str, Mark | None] = {}
        for unit, digest in zip(units, digests):
            base = self._base(unit)
            if base is None or digest is None:
                continue
            hint, mark = self._marked(unit.name, base)
            if unit.name not in confirmed:
                confirmed[unit.name] = self._tracker.confirmed(mark, base)
            if confirmed[unit.name] is not None:
                piece = self.learned.setdefault(unit.name, _Piece(hint, confirmed[unit.name], {}))
                piece.digests[_span(base, unit.data)] = digest


def _span(base: torch.Tensor, view: torch.Tensor) -> Span:
    lo = view.data_ptr() - base.data_ptr()
    return lo, lo + view.nbytes


@contextmanager
def remembering(key: bytes, staged: Any) -> Iterator[_Memory]:
    """The digests remembered for pool ``key``, and what this save adds; kept only if the block ends normally."""
    tracker = write_tracker()
    if tracker is not None:
        tracker.begin()
    with _lock:
        previous = _by_key.pop(key, {})
    memory = _Memory(tracker, staged, previous)
    yield memory
    with _lock:
        _by_key[key] = memory.learned
        while len(_by_key) > KEEP_POOLS:
            _by_key.popitem(last=False)


def _forget_in_child() -> None:
    """A forked child's tracker is its own (``write_tracker``): the parent's marks prove nothing there."""
    global _lock
    _by_key.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
