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
  for it (its buffers are being written), whatever the path. An error is never dropped: the background
  agrees the outcome over the side group before the handle is done, so a save fails on every rank or on
  none; ``wait()`` raises it; if any rank has not seen it, the next call raises it on every rank (the ranks
  agree over the idle side group, only after a failure: a call after a success has no collective in the
  caller's blocked time) and saves nothing.

Ends: ``torch.distributed.destroy_process_group()`` first finishes the save in flight on a group it
destroys (hooked: ``dist.group.before_destroy``), then lets go of the saver, and raises that save's error,
unseen so far, once the groups are gone (every rank has the same). A save in flight when the interpreter
exits (no destroy, an exception, ``sys.exit``) is finished first; if it failed unseen, its error is printed
and the exit status is 1. Either way the side groups are let go while the interpreter is alive (a gloo
group freed during finalization aborts the process).

Value semantics: the checkpoint holds the values at the moment ``async_save`` returned. CPU tensors are
copied before it returns; CUDA tensors are copied to pinned buffers on a side stream that the current
stream then waits for (so the next kernels cannot change them first), and the background waits for the
copies before writing. An incremental save copies only the CPU tensors it cannot prove unchanged since its last
one (``checkpoint.window_hash``: hashed in the call). A kill during the background part leaves the previous checkpoint as it was: the
commit protocol of ``save`` applies unchanged.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import os
import sys
import threading
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shardckpt.checkpoint.progress import ProgressCallback
from shardckpt.checkpoint.save import Planned, SaveOptions, incremental_options, persist, persist_any, plan
from shardckpt.checkpoint.stage import StagingBuffers, stage
from shardckpt.checkpoint.window_hash import WindowDigests, WindowHasher, split_step
from shardckpt.dist.group import (LOCAL, Failure, Group, agreed, attempt, before_destroy, destroys, resolve_group,
                                  side_group)
from shardckpt.gc_pause import gc_paused
from shardckpt.errors import CheckpointError
from shardckpt.io import Storage, is_named, where

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
        """Wait until the checkpoint is committed; raises the save's error (every rank's handle has the same)."""
        error = self.exception(timeout)
        if error is not None:
            raise error


class AsyncSaver:
    """Staging buffers, a side process group and a background thread for one process group's saves.

    Creating one is collective: over every rank of the world when ``process_group`` is the default group
    (it creates the side group); for another group pass ``background_group``, a gloo group of the same
    ranks that you created on every rank of the world (``dist.new_group(ranks, backend="gloo")``) and use
    for nothing else. ``save`` is collective over the group's ranks.
    """

    def __init__(self, process_group: Any = None, background_group: Any = None):
        self.group = resolve_group(process_group)
        self.side: Group = side_group(self.group, background_group)
        self.buffers = StagingBuffers()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-async-save")
        self._last: SaveHandle | None = None
        self._planned: Planned | None = None
        self._window: WindowDigests | None = None  # this rank's digests of the last committed incremental save
        self._pending: WindowDigests | None = None  # the same of the save in flight, once it wrote
        self._lock = threading.Lock()
        _live.add(self)

    @gc_paused  # the caller's window only: the background writing runs with the collector on
    def save(self, state_dict: dict, path: str | os.PathLike | Storage, *, progress: ProgressCallback | None = None,
             **options: Any) -> SaveHandle:
        """``shardckpt.save``'s options; returns once the state is staged (collective, like ``save``).
        ``progress`` is called from the background threads as the staged bytes are written."""
        path = os.fspath(path) if is_named(path) else path  # a Storage is the place itself
        given = SaveOptions(**options)
        incremental_options(given, path=path)  # bad options raise here, not from wait() or the next call
        with self._lock:
            if self.side is None:
                raise CheckpointError("this AsyncSaver's process group was destroyed; use shardckpt.async_save "
                                      "(or a new AsyncSaver) on the new one")
            self._finish_previous()
            pg = self.side.pg if self.side.pg is not None else LOCAL
            run = split_step(where(path))[0]
            window = WindowHasher(self._window_for(given, run)) if given.incremental else None
            staged = stage(state_dict, process_group=pg, metadata=given.metadata, buffers=self.buffers,
                           skip=window.skip if window is not None else None)
            if window is not None:
                staged = dataclasses.replace(staged, prehashed=window.prehashed())

            def write() -> None:
                # A failure to land the copies (CUDA) travels like a staging error: plan raises it on every rank.
                synced = attempt(self.side.rank, self.buffers.synchronize)
                ready = staged if staged.failure or not isinstance(synced, Failure) else \
                    dataclasses.replace(staged, failure=synced)
                planned = plan(ready, path, process_group=pg, overwrite=given.overwrite,
                               files_per_rank=given.files_per_rank, storage_options=given.storage_options,
                               compress=given.compress, reuse=self._planned)
                self._planned = planned
                if window is not None:
                    done = persist_any(ready, planned, given, progress, parent=window.parent)
                    self._pending = window.committed(done.key, given.incremental_unit, where(path), done.units)
                else:
                    persist(ready, planned, progress=progress)

            # The outcome is agreed before the handle is done (a failure on any rank, even in a rank's own
            # tidy-up after the commit, fails every rank's handle), so that the next call needs no collective
            # when the save succeeded: a collective there would be in the caller's blocked time.
            self._last = SaveHandle(self._executor.submit(agreed, self.side, write), where(path))
            return self._last

    def _finish_previous(self) -> None:
        """Wait for the save in flight (its buffers are about to be reused). If it failed (then it failed on every
        rank: the background agreed its outcome) and some rank has not seen the error, raise it on every rank:
        the ranks agree over the (idle) side group, so that all of them raise here or none does. A save that
        succeeded needs no collective: it succeeded on every rank."""
        last = self._last
        if last is None:
            return
        seen = last.observed
        error = last._future.exception()  # an interrupt here keeps _last: the next call waits again
        self._last = None
        self._window, self._pending = (self._pending if error is None else None), None
        if error is None:
            return
        if any(self.side.all_gather(not seen)):
            last.observed = True
            raise error

    def _window_for(self, given: SaveOptions, run: str) -> WindowDigests | None:
        """The last committed incremental save's digests, if this save may compare against them."""
        window = self._window
        if window is None or window.unit_bytes != given.incremental_unit or window.run != run:
            return None
        return window

    def wait(self) -> None:
        """Wait for the save in flight, if any, and raise its error (this rank only; not collective)."""
        last = self._last
        if last is not None:
            last.wait()

    @property
    def staging_bytes(self) -> int:
        """Host memory the staging buffers hold on this rank."""
        return self.buffers.nbytes

    def release(self) -> None:
        """Wait for the save in flight, then free the staging buffers (the next save allocates them again;
        the plan is kept). Local to this rank; a failure of that save is still raised by ``wait()`` or the
        next ``save``."""
        with self._lock:
            if self._last is not None:
                self._last._future.exception()
            self.buffers.release()

    def close(self) -> tuple[str, BaseException] | None:
        """Finish the save in flight, then let go of the side group and the plan (the saver is done: a gloo
        group whose last reference goes during finalization aborts the process, "terminate called without an
        active exception"). Returns that save's path and error if the caller has not seen it (seen from now)."""
        last, unseen = self._last, None
        if last is not None:
            error = last._future.exception()
            if error is not None:
                _drop_frame_locals(error)
            if error is not None and not last.observed:
                last.observed, unseen = True, (last.path, error)
        self.side = self._planned = None
        return unseen


def _drop_frame_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s tracebacks (its chain too): they hold the side
    group, which must not outlive the saver through an error raised at destroy or left to the exit (the same
    abort at finalization). The traceback still prints."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        try:
            traceback.clear_frames(error.__traceback__)
        except RuntimeError:  # a frame still running: not one of the background's
            pass
        error = error.__cause__ or error.__context__


_live: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
_savers: dict[Any, AsyncSaver] = {}  # by id of the process group (saver_for)
_savers_lock = threading.Lock()


def _close_before_destroy(group: Any) -> BaseException | None:
    """``destroy_process_group(group)`` is about to run: finish the saves in flight on the groups it destroys
    (every rank's background goes on until its own destroy, so each finishes) and drop their savers."""
    with _savers_lock:
        closing = [s for s in list(_live) if s.side is not None and
                   (destroys(group, s.group.pg) or destroys(group, s.side.pg))]
        for key in [k for k, s in _savers.items() if s in closing]:
            del _savers[key]
    unseen = [u for u in (saver.close() for saver in closing) if u is not None]
    if not unseen:
        return None
    path, error = unseen[0]
    note = f"shardckpt: the async save to {path}, in flight at destroy_process_group(), failed: nothing was " \
        "committed there"
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):  # Python >= 3.11
        error.add_note(note)
    return error


before_destroy(_close_before_destroy)


def _close_savers_at_exit() -> None:
    """A save in flight when the interpreter exits is finished, not dropped; then the savers let go of their
    groups. An unseen failure is printed and makes the exit status 1. Runs before concurrent.futures refuses
    new work at exit (registered after it, run before it)."""
    unseen = [u for u in (saver.close() for saver in list(_live)) if u is not None]
    for path, error in unseen:
        print(f"shardckpt: the async save to {path} failed: {error!r}; nothing was committed there",
              file=sys.stderr, flush=True)
    _savers.clear()
    if unseen:
        atexit.register(_exit_status_1)  # runs first among the exit handlers


def _exit_status_1() -> None:
    """Run the other exit handlers, flush what the program left open, then end with status 1: an exit handler
    cannot set the status otherwise (a status the program set itself, sys.exit(3), becomes 1 too)."""
    atexit.unregister(_exit_status_1)
    atexit._run_exitfuncs()  # noqa: SLF001
    _flush_open_files()
    os._exit(1)


def _flush_open_files() -> None:
    """Flush every open Python file, as finalization would have (``os._exit`` skips it: a log the program left
    open would lose what it buffered); text files first, so that their bytes reach their buffers."""
    files = [f for f in gc.get_objects() if isinstance(f, io.IOBase)]
    for f in sorted(files, key=lambda f: not isinstance(f, io.TextIOBase)):
        try:
            if not f.closed and f.writable():
                f.flush()
        except (OSError, ValueError):  # a broken pipe, a closed descriptor: nothing more to do for it
            pass


threading._register_atexit(_close_savers_at_exit)  # noqa: SLF001 - the hook concurrent.futures uses itself


def _forget_savers_in_child() -> None:
    """A forked child has none of the savers' threads (its process groups are not its own either)."""
    global _savers_lock
    _savers.clear()
    _savers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_savers_in_child)


def saver_for(process_group: Any = None, background_group: Any = None) -> AsyncSaver:
    """The ``AsyncSaver`` of ``process_group`` (default: the default group), created on first use (see
    ``AsyncSaver`` for what creating one needs; one its user closed is replaced)."""
    key = id(resolve_group(process_group).pg)
    with _savers_lock:
        if key not in _savers or _savers[key].side is None:
            _savers[key] = AsyncSaver(process_group, background_group)
        return _savers[key]


def async_save(state_dict: dict, path: str | os.PathLike | Storage, *, process_group: Any = None,
               background_group: Any = None, **options: Any) -> SaveHandle:
    """Save like ``shardckpt.save`` (same options), returning once the state is copied into this rank's
    staging buffers; the rest runs in the background (see the module docstring). Collective.
    ``background_group``: needed on the first call for a ``process_group`` other than the default group."""
    return saver_for(process_group, background_group).save(state_dict, path, **options)


def release(process_group: Any = None) -> None:
    """Free ``process_group``'s staging buffers after its save in flight ends (no-op if it has none)."""
    saver = _savers.get(id(resolve_group(process_group).pg))
    if saver is not None:
        saver.release()
