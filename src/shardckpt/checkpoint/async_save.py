"""``async_save``: the caller is blocked only while its state is copied into reused host buffers; planning,
writing, checksums and the commit run in a background thread, on a process group of their own.

    handle = shardckpt.async_save(state, path)   # returns once the state is copied (staged)
    optimizer.step()                             # in-place updates from here on do not reach the checkpoint
    handle.wait()                                # raises what the background raised, on every rank

Each process group gets one ``AsyncSaver`` (created by its first ``async_save``, collectively): it holds

- the staging buffers (``stage.StagingBuffers``): one host copy of every tensor this rank stores (its
  shards, and the plain tensors: which rank writes a replicated tensor is decided later), reused by the
  next save of the same shapes; ``release()`` frees them;
- a gloo group of the same ranks (``dist.group.side_group``), created once, on which the background
  ``plan`` and ``persist`` run, so that their collectives never interleave with the training's;
- the last save's plan: a save whose pieces are as they were reuses it (``plan(reuse=...)``), so that
  the background does not gather every rank's metadata and plan again;
- one background thread. **One save at a time**: a call while the previous save is in flight first waits
  for it (its buffers are being written), whatever the path, and raises its error if it failed and
  nobody called ``wait()``. An error is never dropped: ``wait()`` raises it, else the next call does.

Value semantics: the checkpoint holds the values at the moment ``async_save`` returned. CPU tensors are
copied before it returns; CUDA tensors are copied to pinned buffers on a side stream that the current
stream then waits for (so the next kernels cannot change them first), and the background waits for the
copies before writing. A kill during the background part leaves the previous checkpoint as it was: the
commit protocol of ``save`` applies unchanged.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shardckpt.checkpoint.save import DEFAULT_FILES_PER_RANK, Planned, persist, plan
from shardckpt.checkpoint.stage import StagingBuffers, stage
from shardckpt.dist.group import LOCAL, Group, resolve_group, side_group

__all__ = ["async_save", "AsyncSaver", "SaveHandle", "saver_for", "release"]


class SaveHandle:
    """One asynchronous save: ``done()``, ``wait()`` (raises the save's error), ``exception()``."""

    def __init__(self, future: Future, path: str):
        self._future = future
        self.path = path
        self.observed = False  # whether the outcome reached the caller

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; its error or None (the error then counts as seen)."""
        error = self._future.exception(timeout)
        self.observed = True
        return error

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is committed (or failed: raises the error, on every rank)."""
        error = self.exception(timeout)
        if error is not None:
            raise error


class AsyncSaver:
    """Staging buffers, a side process group and a background thread for one process group's saves."""

    def __init__(self, process_group: Any = None):
        self.group = resolve_group(process_group)
        self.side: Group = side_group(self.group)
        self.buffers = StagingBuffers()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-async-save")
        self._last: SaveHandle | None = None
        self._planned: Planned | None = None
        self._lock = threading.Lock()

    def save(self, state_dict: dict, path: str | os.PathLike, *, overwrite: bool = False,
             metadata: dict | None = None, files_per_rank: int = DEFAULT_FILES_PER_RANK,
             storage_options: dict | None = None, compress: str | None = None) -> SaveHandle:
        """``shardckpt.save``'s options; returns once the state is staged (collective, like ``save``)."""
        with self._lock:
            self._finish_previous()
            pg = self.side.pg if self.side.pg is not None else LOCAL
            staged = stage(state_dict, process_group=pg, metadata=metadata, buffers=self.buffers)

            def background() -> None:
                self.buffers.synchronize()
                planned = plan(staged, path, process_group=pg, overwrite=overwrite, files_per_rank=files_per_rank,
                               storage_options=storage_options, compress=compress, reuse=self._planned)
                self._planned = planned
                persist(staged, planned)

            self._last = SaveHandle(self._executor.submit(background), os.fspath(path))
            return self._last

    def _finish_previous(self) -> None:
        last, self._last = self._last, None
        if last is not None and not last.observed:
            last.wait()  # its buffers are about to be overwritten; its error, if nobody saw it, is raised here

    def wait(self) -> None:
        """Wait for the save in flight, if any (raising its error if nobody has seen it)."""
        with self._lock:
            self._finish_previous()

    @property
    def staging_bytes(self) -> int:
        """Host memory the staging buffers hold on this rank."""
        return self.buffers.nbytes

    def release(self) -> None:
        """Wait for the save in flight, then free the staging buffers (the next save allocates them again)."""
        with self._lock:
            try:
                self._finish_previous()
            finally:
                self.buffers.release()
                self._planned = None


_savers: dict[Any, AsyncSaver] = {}
_savers_lock = threading.Lock()


def _forget_savers_in_child() -> None:
    """A forked child has none of the savers' threads (its process groups are not its own either)."""
    global _savers_lock
    _savers.clear()
    _savers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_savers_in_child)


def saver_for(process_group: Any = None) -> AsyncSaver:
    """The ``AsyncSaver`` of ``process_group`` (default: the default group), created on first use; creating
    it is collective over the group's ranks."""
    key = id(resolve_group(process_group).pg)
    with _savers_lock:
        if key not in _savers:
            _savers[key] = AsyncSaver(process_group)
        return _savers[key]


def async_save(state_dict: dict, path: str | os.PathLike, *, process_group: Any = None, **options: Any) -> SaveHandle:
    """Save like ``shardckpt.save`` (same options), returning once the state is copied into this rank's
    staging buffers; the rest runs in the background (see the module docstring). Collective."""
    return saver_for(process_group).save(state_dict, path, **options)


def release(process_group: Any = None) -> None:
    """Free ``process_group``'s staging buffers after its save in flight ends (no-op if it has none)."""
    saver = _savers.get(id(resolve_group(process_group).pg))
    if saver is not None:
        saver.release()
