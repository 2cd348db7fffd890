"""Local disk: pread/pwrite straight into and out of tensor memory, fsync, rename for the commit."""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import threading
import time
import uuid
from typing import Callable

from shardckpt.errors import CheckpointError, CorruptCheckpointError
from shardckpt.io.direct import DIRECT_BUFFER, DirectWriter, open_direct
from shardckpt.io.protocol import MAX_IO, missing


WRITEBACK_BYTES = 16 << 20  # start the disk on every this many bytes written, instead of all at fsync
SERIAL_BELOW = 32 << 20  # local reads and writes of fewer bytes in all are done in one thread (``one_thread_suits``)


def one_thread_suits(storage: object, nbytes: int) -> bool:
    """Whether to read or write ``nbytes`` in all on ``storage`` in one thread rather than several: on local disk
    below ``SERIAL_BELOW``, where threads save no disk time and their GIL hand-offs cost more than the copying (many
    small tensors: 19,200 of 512 bytes saved in 0.63 s in one thread, 0.73 s in two). On object stores threads
    hide each request's latency, whatever the size."""
    return isinstance(storage, LocalStorage) and nbytes < SERIAL_BELOW


def _writeback_starter():
    """Linux's ``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``: starts writing dirty pages back
    without waiting, so that the disk works while the writer goes on (e.g. compressing the next frames)
    and the closing fsync has little left. ``None`` where it is missing (the fsync then does it all)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_START_WRITEBACK = _writeback_starter()
_SYNC_FILE_RANGE_WRITE = 2


def _open_held(path: str, keep: int | None, direct: bool) -> tuple[int, bool]:
    """A descriptor of a new (emptied) file at ``path``; or, ``keep`` given, of the existing file, cut to its first
    ``keep`` bytes (``FileNotFoundError`` if it is gone); held (``_hold``). ``direct``: opened with ``O_DIRECT``
    where the file system allows it. Returns the descriptor and whether it is direct."""
    while True:
        flags = os.O_WRONLY if keep is not None else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = open_direct(path, flags, 0o644) if direct else None
        is_direct = fd is not None
        fd = fd if is_direct else os.open(path, flags, 0o644)
        _hold(fd)  # a file being written is not debris (remove_abandoned), until closed
        if _still_named(path, fd):
            break
        os.close(fd)  # removed as abandoned between our open and our hold (as hold_dir): make it again
        if keep is not None:  # (what was kept is gone with it)
            raise FileNotFoundError(path)
    if keep is not None:
        os.ftruncate(fd, keep)
    return fd, is_direct


class _LocalWriter:
    positional = True

    def __init__(self, fd: int, keep: int | None = None, durable: bool = True):
        """Writes through the page cache to ``fd`` (from ``_open_held``), after its first ``keep`` bytes.
        ``durable=False``: no writeback started and no fsync at close (a copy that need not survive the node,
        e.g. a tier-0 copy on a tmpfs)."""
        self._fd, self._durable = fd, durable
        self._pos = keep or 0
        self._started = self._pos  # bytes [0, _started) are written back already or being written back

    def write(self, data: memoryview) -> None:
        self.pwrite(data, self._pos)
        self._pos += data.nbytes
        if self._durable and _START_WRITEBACK is not None and self._pos - self._started >= WRITEBACK_BYTES:
            _START_WRITEBACK(self._fd, self._started, self._pos - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = self._pos

    def pwrite(self, data: memoryview, offset: int) -> None:
        data = data.cast("B")
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:done + MAX_IO], offset + done)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return  # closed already, even if that close raised: the number may be another file's descriptor now
        try:
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)


def _new_writer(path: str, keep: int | None = None, direct: bool = False,
                durable: bool = True) -> _LocalWriter | DirectWriter:
    """A writer of ``path``, its directory made first, and made again should it vanish before the file is
    created in it (an empty directory a collector removed: ``LocalStorage.remove_empty_dir``). ``direct``: past
    the page cache (``io.direct``) where the file system allows it; a file written on after ``keep`` bytes never
    is (its tail need not be aligned)."""
    for _ in range(100):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd, is_direct = _open_held(path, keep, direct and keep is None)
            return DirectWriter(fd) if is_direct else _LocalWriter(fd, keep, durable)
        except FileNotFoundError:
            if keep is not None or os.path.isdir(os.path.dirname(path)):
                raise
    raise FileNotFoundError(path)


def _still_named(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file (or directory) open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _hold(fd: int) -> None:
    """A shared flock on ``fd``: another process's exclusive attempt fails while we live (none if unsupported)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass


class _DirHold:
    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


class LocalStorage:
    """A directory on local disk. ``durable=False``: files written are not fsynced (nor directories), for a copy
    that a process restart must keep but a node crash may lose (tier 0 of ``shardckpt.tiers``)."""

    shown: str | None = None  # the path it was opened by (``io.named``)

    def __init__(self, root: str, direct_io: bool | None = None, durable: bool = True):
        """``direct_io``: write data files past the page cache (``io.direct``); default on, unless the environment
        sets ``SHARDCKPT_DIRECT_IO=0``, and never for a store that is not ``durable`` (its copies live in memory)."""
        self.root = os.path.abspath(root)
        self.durable = durable
        self.direct_io = durable and (os.environ.get("SHARDCKPT_DIRECT_IO", "1") != "0" if direct_io is None
                                      else direct_io)
        self._pinned: dict[str, int] = {}
        self._pins = 0  # pin() calls not yet released: the descriptors close when the last one is
        self._pin_lock = threading.Lock()

    def url(self, path: str) -> str:
        return os.path.join(self.root, path)

    @property
    def writer_bytes(self) -> int:
        """Memory each open writer of a new file holds (``offline.memory.writer_reserve``): a direct writer's buffer."""
        return DIRECT_BUFFER if self.direct_io else 0

    def exists(self, path: str) -> bool:
        return os.path.exists(self.url(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(self.url(path), "rb") as f:
                return f.read()
        except OSError as e:
            raise missing(self.url(path), e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        url = self.url(path)
        out = out.cast("B")
        pinned = self._pinned.get(path)
        try:
            fd = os.open(url, os.O_RDONLY) if pinned is None else pinned
        except OSError as e:
            raise missing(url, e) from e
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:done + MAX_IO]], offset + done)
                if n == 0:
                    raise CorruptCheckpointError(f"{url}: file is truncated (wanted bytes up to "
                                                 f"{offset + len(out)}, it ends at {offset + done})")
                done += n
        finally:
            if pinned is None:
                os.close(fd)

    def pin(self, paths: list[str]) -> None:
        with self._pin_lock:
            for path in paths:
                if path not in self._pinned:
                    try:
                        self._pinned[path] = os.open(self.url(path), os.O_RDONLY)
                    except OSError as e:
                        if not self._pins:
                            self._close_pinned()
                        raise missing(self.url(path), e) from e
            self._pins += 1

    def release(self) -> None:
        with self._pin_lock:
            self._pins = max(0, self._pins - 1)
            if not self._pins:
                self._close_pinned()

    def _close_pinned(self) -> None:
        for fd in self._pinned.values():
            os.close(fd)
        self._pinned.clear()

    def is_dir(self, path: str = "") -> bool:
        return os.path.isdir(self.url(path))

    def list_files(self, path: str = "") -> list[str]:
        return self._names(path, lambda e: e.is_file())

    def _names(self, path: str, keep: Callable[[os.DirEntry], bool]) -> list[str]:
        try:
            with os.scandir(self.url(path)) as entries:
                return sorted(e.name for e in entries if _kept(e, keep))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def file_size(self, path: str) -> int:
        try:
            return os.stat(self.url(path)).st_size
        except OSError as e:
            raise missing(self.url(path), e) from e

    def open_writer(self, path: str, keep: int | None = None, direct: bool | None = None) -> _LocalWriter | DirectWriter:
        """The protocol's writer (past the page cache where ``direct``, default ``direct_io``); local disk also goes
        on writing an existing file after its first ``keep`` bytes (what follows is cut off), which a resumed
        ``convert`` uses."""
        return _new_writer(self.url(path), keep, self.direct_io if direct is None else direct, self.durable)

    def put_atomic(self, path: str, data: bytes, exclusive: bool = False) -> None:
        """Write to a temporary name, fsync, then rename it over ``path`` (or, ``exclusive``, hard-link it to
        ``path``, which fails if the name exists, and drop the temporary name); fsync the directory."""
        tmp = self.url(f"{path}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            writer = _new_writer(tmp)
            writer.write(memoryview(data))
            os.fsync(writer._fd)
            # Closed (its hold released) only once it has its final name: never debris while live.
            if exclusive:
                os.link(tmp, self.url(path))
                os.unlink(tmp)
            else:
                os.replace(tmp, self.url(path))
            writer.close()
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.sync_dir(os.path.dirname(path))

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(self.url(path), ignore_errors=True)

    def list_dirs(self, path: str = "") -> list[str]:
        return self._names(path, lambda e: e.is_dir(follow_symlinks=False))

    def hold_dir(self, path: str, exclusive: bool = False, wait: bool = False) -> _DirHold:
        """See the protocol; ``wait`` (local only): an exclusive hold waits for the other holders to let go
        instead of raising (for short critical sections, such as an export's renames)."""
        url = self.url(path)
        while True:
            try:
                os.makedirs(url, exist_ok=True)
            except FileExistsError:  # it was there when made, gone when checked: being removed as abandoned
                if os.path.lexists(url):
                    raise
                continue
            try:
                fd = os.open(url, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:  # removed as abandoned between our mkdir and our open: make it again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH if not exclusive else fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(f"{url}: another live process is writing this directory") from None
            except OSError:  # no locks here (some network file systems): remove_abandoned removes nothing
                return _DirHold(fd)
            if _still_named(url, fd):
                return _DirHold(fd)
            os.close(fd)  # removed as abandoned between our mkdir and our lock: make it again

    def remove_abandoned(self, path: str, min_age_s: float, dry_run: bool = False,
                         unused: Callable[[], bool] = lambda: True) -> bool:
        url = self.url(path)
        if not os.path.isdir(url) or os.path.islink(url):
            try:
                fd = os.open(url, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:  # gone, or a link
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still being written: OSError
                if time.time() - os.fstat(fd).st_mtime < min_age_s or not unused():
                    return False
                if not dry_run:
                    os.unlink(url)
                return True
            except OSError:
                return False
            finally:
                os.close(fd)
        try:
            fd = os.open(url, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live writer, or unsupported: OSError
        except OSError:
            os.close(fd)
            return False
        try:  # removed while we hold the lock, so a writer about to hold it makes it again
            if not unused():  # e.g. committed since the caller looked: its writer held it until then
                return False
            if not dry_run:
                shutil.rmtree(url, ignore_errors=True)
            return True
        finally:
            os.close(fd)

    def remove_empty_dir(self, path: str) -> bool:
        """Remove directory ``path`` if it is empty and no one holds it (an export holds its destination),
        and say whether it was. ``rmdir`` refuses a directory that is not empty, atomically: a save that
        has made its data directory inside it keeps it; one that has not yet makes it again (``hold_dir``,
        ``open_writer`` and ``put_atomic`` make their parents again when they vanish)."""
        try:
            fd = os.open(self.url(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone, or not a directory
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, or no locks here: OSError, keep it
            os.rmdir(self.url(path))
            return True
        except OSError:  # not empty (ENOTEMPTY), or gone meanwhile
            return False
        finally:
            os.close(fd)

    def sync_dir(self, path: str) -> None:
        if not self.durable:
            return
        fd = os.open(self.url(path) if path else self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _kept(entry: os.DirEntry, keep: Callable[[os.DirEntry], bool]) -> bool:
    """``keep(entry)``; an entry that cannot even be told a file or a directory (a symbolic link loop) is an
    unreadable file, named."""
    try:
        return keep(entry)
    except OSError as e:
        raise missing(entry.path, e) from e
