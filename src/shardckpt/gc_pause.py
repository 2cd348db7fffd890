"""Python's cyclic garbage collector paused while a save or load handles its metadata.

A checkpoint of many small tensors makes hundreds of thousands of short-lived objects (pieces, plan rows, manifest
entries), and each of CPython's full collections then walks every live object of the process, the caller's state
dict included: measured, half of a 19,200-tensor save's or load's CPU time (benchmarks/README.md, "Many small
tensors"). Reference counting still frees what is not in a cycle; cycles made meanwhile are collected after.

Pauses nest and may come from several threads: the collector is enabled again when the last one ends, and only if
it was enabled when the first began. Long background work (an async save's writing) does not pause it: the caller's
training would keep its cyclic garbage for as long."""
from __future__ import annotations

import functools
import gc
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_depth = 0
_was_enabled = False


def _enter() -> None:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()


def gc_paused(fn: F) -> F:
    """``fn`` with the cyclic collector paused while it runs (see the module docstring)."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        _enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _exit()
    return paused  # type: ignore[return-value]
