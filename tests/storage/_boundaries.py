"""The step boundaries of a writer, for tests that act at each one deterministically (no timing): every storage
operation a writer makes is numbered in the order made, and an action can run before any one of them.

Operations: a storage's ``open_writer``, ``put_atomic``, ``remove_dir``, ``remove_abandoned``, ``hold_dir``,
``hold_file``; a file writer's first ``write``/``pwrite``, its ``sync`` and ``close``; an export's ``rename``
and ``remove`` (``convert.safetensors_files``); and the two windows inside local operations where a
collector once struck: after ``hold_dir`` made its directory (before it opened and locked it), and after a
local file writer created its file (before it locked it). An operation made inside another (S3's retries
around the fsspec base class) counts once.

Commits: after an operation that commits an output returns (the put of ``manifest.json`` or of an export's
index, the rename of an export's index or single file into place, an object store's close of a single-file
export), a line ``commit ROLE NS`` goes to the events file: ROLE is the process's (``A`` the writer under
test, ``B`` the second writer; ``old`` when an export renames the old index back), NS is CLOCK_MONOTONIC,
which every process on the machine shares. The last commit names the output a reader must find.

Actions (``Spec.action``): ``kill`` (SIGKILL this process), ``gc`` (``shardckpt gc`` of the path, in this
process), ``writer2`` (a second writer at the path, run to completion by the ``SecondWriter`` server process;
when the writer under test holds the lock an export commits under, the second one waits for it, as a real
second process would: the action returns once it blocks there). The action's own operations are not numbered.
``Spec.kill_at`` kills the writer under test as well, once that later operation returns (a second writer,
then a kill).

Spawned processes (``convert --workers``) install and arm themselves from the ``SHARDCKPT_BOUNDARY``
environment variable in ``worker``, which the test puts in place of ``offline.workers._worker``.
"""
from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Client, Listener
from typing import Any, Callable

ENV = "SHARDCKPT_BOUNDARY"
INDEX, SINGLE, MANIFEST = "model.safetensors.index.json", "model.safetensors", "manifest.json"


@dataclass
class Spec:
    """What one process does at its boundaries (JSON, for spawned workers)."""

    events: str  # the events file
    role: str = "A"
    at: int | None = None  # the boundary to act at (None: only number them)
    action: str = ""  # kill | gc | writer2
    worker: int | None = None  # convert --workers: the worker that acts (by its rank)
    gc: dict = field(default_factory=dict)  # gc(open_storage(path, storage_options), **the rest)
    writer2: dict = field(default_factory=dict)  # {"call": "module:function", "args": [...], "kwargs": {...}}
    server: str = ""  # the SecondWriter's address
    kill_at: int | None = None  # SIGKILL this process as well, once that operation returns


class _State(threading.local):
    depth = 0  # operations in progress on this thread
    quiet = 0  # an action running on this thread: its operations are not boundaries
    in_hold_dir = False


_local = _State()
_lock = threading.Lock()
_spec: Spec | None = None
_count = 0
_rank: int | None = None  # this process's worker rank (convert --workers), None elsewhere
_commit_lock_held = False  # this process holds an export's commit lock (hold_dir(wait=True))
_originals: list[tuple[Any, str, Any]] = []
_blocked: Callable[..., None] | None = None  # the SecondWriter's "I am about to wait for the lock"


def _log(line: str) -> None:
    if _spec is not None:
        fd = os.open(_spec.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def _boundary(label: str) -> int | None:
    """Number the operation about to be made (returned), and act if it is the one to act at."""
    global _count
    if _spec is None or _local.quiet:
        return None
    with _lock:
        k, _count = _count, _count + 1
    if _spec.role == "A":
        _log(f"op {_rank if _rank is not None else '-'} {k} {label}")
    if _spec.at == k and (_spec.worker is None or _spec.worker == _rank):
        _local.quiet += 1
        try:
            ACTIONS[_spec.action](_spec)
        finally:
            _local.quiet -= 1
    return k


def _base(path: Any) -> str:
    return os.path.basename(os.fspath(path).rstrip("/"))


def _wrap(owner: Any, name: str, label: Callable[..., str], commits: Callable[..., str | None] | None = None):
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        outer = _local.depth == 0
        k = _boundary(label(*args, **kwargs)) if outer else None
        _local.depth += 1
        try:
            out = real(*args, **kwargs)
        finally:
            _local.depth -= 1
        role = commits(*args, **kwargs) if outer and commits is not None else None
        if role is not None:
            _log(f"commit {role} {time.monotonic_ns()}")
        if k is not None and _spec is not None and _spec.kill_at == k and _spec.role == "A":
            _kill(_spec)  # once the operation is done (Spec.kill_at)
        return out

    _originals.append((owner, name, real))
    setattr(owner, name, wrapped)


def _put_commits(self, path, *a, **k) -> str | None:
    return _spec.role if path in (MANIFEST, INDEX) else None


def _rename_commits(storage, old, new) -> str | None:
    if new not in (INDEX, SINGLE):
        return None
    return "old" if old.endswith(".old") else _spec.role  # an export moving the old index back


def _close_commits(self) -> str | None:
    from shardckpt.io.direct import DirectWriter
    from shardckpt.io.local import _LocalWriter

    return _spec.role if not isinstance(self, (_LocalWriter, DirectWriter)) and getattr(self, "_bnd_path", "") == SINGLE else None


def install(spec: Spec) -> None:
    """Number this process's operations per ``spec`` from now on (wraps the classes once)."""
    global _spec, _count
    _spec, _count = spec, 0
    if _originals:
        return
    from shardckpt.offline import safetensors_files
    from shardckpt.io import direct, local, remote, s3, s3_transfer

    for cls in (local.LocalStorage, remote.FsspecStorage, s3.S3Storage):
        for name in ("put_atomic", "remove_dir", "remove_abandoned"):
            if name in vars(cls):
                _wrap(cls, name, lambda self, path, *a, _n=name, **k: f"{_n} {path}",
                      _put_commits if name == "put_atomic" else None)
        if "open_writer" in vars(cls):
            _wrap_open_writer(cls)
    if hasattr(local.LocalStorage, "hold_file"):
        _wrap(local.LocalStorage, "hold_file", lambda self, path, *a, **k: f"hold_file {path}")
    _wrap_hold_dir(local.LocalStorage)
    for cls in (local._LocalWriter, direct.DirectWriter, remote._FsspecWriter, s3_transfer.MultipartWriter):
        for name in ("write", "pwrite"):
            if name in vars(cls):
                _wrap_first_write(cls, name)
        for name in ("sync", "close"):
            if name in vars(cls):
                _wrap(cls, name, lambda self, _n=name: f"{_n} {getattr(self, '_bnd_path', '?')}",
                      _close_commits if name == "close" else None)
    _wrap(safetensors_files, "rename", lambda storage, old, new: f"rename {old} -> {new}", _rename_commits)
    _wrap(safetensors_files, "remove", lambda storage, name: f"remove {name}")
    _wrap_windows(local)


def _wrap_open_writer(cls) -> None:
    real = cls.open_writer

    def open_writer(self, path: str, *args, **kwargs):
        writer = real(self, path, *args, **kwargs)
        writer._bnd_path = _base(path)
        return writer

    _originals.append((cls, "open_writer", real))
    cls.open_writer = open_writer
    _wrap(cls, "open_writer", lambda self, path, *a, **k: f"open_writer {path}")


def _wrap_first_write(cls, name: str) -> None:
    real = getattr(cls, name)

    def first(self, *args, **kwargs):
        if _local.depth == 0 and not getattr(self, "_bnd_wrote", False):
            self._bnd_wrote = True
            _boundary(f"write {getattr(self, '_bnd_path', '?')}")
        return real(self, *args, **kwargs)

    _originals.append((cls, name, real))
    setattr(cls, name, first)


def _held_exclusively(url: str) -> bool:
    """Whether another holder has directory ``url`` locked exclusively (a shared ``flock`` would wait)."""
    import fcntl

    try:
        fd = os.open(url, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _wrap_hold_dir(cls) -> None:
    real = cls.hold_dir

    def hold_dir(self, path: str, exclusive: bool = False, wait: bool = False):
        global _commit_lock_held
        if wait and _blocked is not None:
            _blocked()  # the writer under test holds it: this second writer waits now
        elif not exclusive and _blocked is not None and _held_exclusively(self.url(path)):
            _blocked(True)  # a shared hold waits for the writer under test's collector (its tidy-up's sweep)
        _local.in_hold_dir = True
        try:
            hold = real(self, path, exclusive, wait) if wait else real(self, path, exclusive)
        finally:
            _local.in_hold_dir = False
        if wait:
            _commit_lock_held = True
            release = hold.release

            def released() -> None:
                global _commit_lock_held
                _commit_lock_held = False
                release()

            hold.release = released
        return hold

    _originals.append((cls, "hold_dir", real))
    cls.hold_dir = hold_dir
    _wrap(cls, "hold_dir", lambda self, path, *a, **k: f"hold_dir {path or '.'}")


def _wrap_windows(local) -> None:
    """The windows inside local operations: after hold_dir's mkdir, after a file writer's create."""
    real_makedirs, real_hold = os.makedirs, local._hold

    def makedirs(path, *args, **kwargs):
        real_makedirs(path, *args, **kwargs)
        if _local.in_hold_dir:
            _local.depth, depth = 0, _local.depth
            try:
                _boundary(f"after mkdir {_base(path)}")
            finally:
                _local.depth = depth

    def hold(fd: int) -> None:
        _local.depth, depth = 0, _local.depth
        try:
            _boundary(f"after create {os.path.basename(os.readlink(f'/proc/self/fd/{fd}'))}")
        finally:
            _local.depth = depth
        real_hold(fd)

    _originals.extend([(os, "makedirs", real_makedirs), (local, "_hold", real_hold)])
    os.makedirs, local._hold = makedirs, hold


def uninstall() -> None:
    global _spec
    for owner, name, real in reversed(_originals):
        setattr(owner, name, real)
    _originals.clear()
    _spec = None


def events(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.rstrip("\n").split(" ", 3) for line in f]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------------------------
# Actions


def _call(what: dict) -> Any:
    module, name = what["call"].split(":")
    return getattr(importlib.import_module(module), name)(*what.get("args", ()), **what.get("kwargs", {}))


def _kill(spec: Spec) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _gc(spec: Spec) -> None:
    from shardckpt.checkpoint.gc import gc
    from shardckpt.errors import CheckpointError
    from shardckpt.io import open_storage

    args = dict(spec.gc)
    try:
        done = {"removed": gc(open_storage(args.pop("path"), args.pop("storage_options", None)), **args)}
    except Exception as e:  # noqa: BLE001 - recorded for the test (a CheckpointError: gc refused, e.g. no path yet)
        done = {"error": f"{type(e).__name__}: {e}", "checkpoint_error": isinstance(e, CheckpointError)}
    _log(f"gc {_rank if _rank is not None else '-'} {json.dumps(done)}")


_pending: list = []  # connections to the SecondWriter whose run goes on (it waits for our lock)


def _writer2(spec: Spec) -> None:
    conn = Client(spec.server, family="AF_UNIX")
    conn.send((spec.writer2, spec.events, _commit_lock_held))
    if not conn.poll(300):  # a safety net against a hang, not a timing: it answers within a second
        raise RuntimeError("the second writer neither finished nor blocked")
    if conn.recv() == "blocked":
        _pending.append(conn)  # finished once we let go of the lock: see finish_second_writer
    else:
        conn.close()


def finish_second_writer() -> None:
    """Wait for a second writer that was waiting for the lock (called once the writer under test is done)."""
    while _pending:
        conn = _pending.pop()
        conn.recv()
        conn.close()


ACTIONS: dict[str, Callable[[Spec], None]] = {"kill": _kill, "gc": _gc, "writer2": _writer2}


# ---------------------------------------------------------------------------------------------------------
# The second writer's process, and convert --workers' workers


class SecondWriter:
    """A process (spawned once) that runs second writers on request: one at a time, each to completion,
    in role B; it answers ``blocked`` when the writer is about to wait for the lock the writer under test
    holds, and ``done`` when it ends (its outcome goes to the events file as ``writer2 OUTCOME``)."""

    def __init__(self, root: str):
        self.address = os.path.join(root, "second-writer.sock")
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        self.process = ctx.Process(target=_serve, args=(self.address, ready), daemon=True)
        self.process.start()
        if not ready.wait(300):
            raise RuntimeError("the second writer's process did not start")

    def wait_idle(self) -> None:
        """Return once the last second writer has ended: one the writer under test left waiting for its lock
        goes on when that writer is killed, and must neither outlive its case (the next case resets the path
        under it) nor log its outcome into the next case's events. The process serves one request at a time,
        so this one is answered after it."""
        conn = Client(self.address, family="AF_UNIX")
        conn.send("idle?")
        if not conn.poll(600):  # a safety net against a hang, not a timing
            raise RuntimeError("the second writer did not end")
        conn.recv()
        conn.close()

    def close(self) -> None:
        try:
            conn = Client(self.address, family="AF_UNIX")
            conn.send(None)
            conn.close()
        except OSError:
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _serve(address: str, ready) -> None:
    global _blocked
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the test process
    import torch

    torch.set_num_threads(1)
    import shardckpt  # noqa: F401 - imported before the first request
    from shardckpt.errors import CheckpointError

    listener = Listener(address, family="AF_UNIX")
    ready.set()
    while True:
        conn = listener.accept()
        request = conn.recv()
        if request is None:
            break
        if request == "idle?":  # SecondWriter.wait_idle
            conn.send("idle")
            conn.close()
            continue
        what, events_path, lock_held = request
        install(Spec(events_path, role="B"))
        told = []

        def blocked(shared: bool = False) -> None:
            if (lock_held or shared) and not told:
                told.append(1)
                try:
                    conn.send("blocked")
                except OSError:  # as for "done" below
                    pass

        _blocked = blocked
        try:
            _call(what)
            outcome = "ok"
        except CheckpointError as e:
            outcome = f"refused {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - recorded for the test
            outcome = f"error {type(e).__name__}: {e}"
        _blocked = None
        _log(f"writer2 - {outcome}")
        try:
            conn.send("done")
        except OSError:  # the writer under test was killed meanwhile (Spec.kill_at): nobody waits for it
            pass
        conn.close()
    listener.close()


def worker(rank: int, *args) -> None:
    """``offline.workers._worker`` with this process's boundaries numbered and armed (``ENV``)."""
    global _rank
    from shardckpt.offline import workers

    spec = os.environ.get(ENV)
    if spec:
        _rank = rank
        install(Spec(**json.loads(spec)))
    try:
        workers._worker(rank, *args)
    finally:
        finish_second_writer()


def spec_env(spec: Spec) -> str:
    return json.dumps(asdict(spec))
