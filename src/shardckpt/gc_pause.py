"""Python's cyclic garbage collector paused while a save or load handles its metadata.

A checkpoint of many small tensors makes hundreds of thousands of short-lived objects (pieces, plan rows, manifest
entries), and each of CPython's full collections then walks every live object of the process, the caller's state
dict included: measured, half of a 19,200-tensor save's or load's CPU time (benchmarks/README.md, "Many small
tensors"). Reference counting still frees what is not in a cycle; cycles made meanwhile are collected after.

Pauses nest and may come from several threads: the collector is enabled again when the last one ends, and only if
it was enabled when the first began (a ``gc.disable()`` made while a pause runs is undone with it). Long background
work (an async save's writing) does not pause it: the caller's training would keep its cyclic garbage for as long.
An interrupt (KeyboardInterrupt) landing inside the bookkeeping itself can leave the collector off until the next
pause ends, which then restores it; a process forked during a pause starts with the collector as it was before."""
from __future__ import annotations

import functools
import gc
import os
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_ours = False  # the collector is (or is about to be) off because of a pause: the next one keeps _was_enabled


def _enter() -> None:
    global _depth, _was_enabled, _ours
    with _lock:
        if _depth == 0:
            if not _ours:  # (set: a pause was interrupted before its end restored the collector)
                _was_enabled = gc.isenabled()
            _ours = True
            gc.disable()
        _depth += 1


def _exit() -> None:
    global _depth, _ours
    with _lock:
        _depth = max(_depth - 1, 0)
        if _depth == 0:
            if _was_enabled:
                gc.enable()
            _ours = False


def _after_fork_in_child() -> None:
    """The pausing threads are not in a forked child: its collector goes back to what it was before them."""
    global _lock, _depth, _ours
    _lock = threading.Lock()
    if _depth or _ours:
        _depth, _ours = 0, False
        if _was_enabled:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def gc_paused(fn: F) -> F:
    """``fn`` with the cyclic collector paused while it runs (see the module docstring)."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        try:  # entered inside: an interrupt just after _enter still ends the pause (one before it ends another's early)
            _enter()
            return fn(*args, **kwargs)
        finally:
            _exit()
    return paused  # type: ignore[return-value]
