"""Where checkpoint bytes live: local disk (os, pread/pwrite, fsync) or any fsspec URL (s3://, memory://, ...).

The protocol is narrow on purpose: ranged reads into caller buffers, a streaming file writer, an
atomic single-object put (the commit), existence checks and deletion. Nothing relies on rename
except the local commit, where rename is atomic.
"""
from __future__ import annotations

import os
import posixpath
import uuid
from typing import Protocol

from shardckpt.errors import CheckpointError, CorruptCheckpointError

_MAX_IO = 1 << 30  # bytes per read/write syscall; Linux caps one call just below 2 GiB


class FileWriter(Protocol):
    positional: bool  # True: pwrite() from several threads at once; False: write() in order only

    def write(self, data: memoryview) -> None: ...

    def pwrite(self, data: memoryview, offset: int) -> None: ...

    def close(self) -> None:
        """Make the file durable (fsync on local disk) and close it."""


class Storage(Protocol):
    root: str

    def url(self, path: str) -> str: ...

    def exists(self, path: str) -> bool: ...

    def read_bytes(self, path: str) -> bytes: ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None: ...

    def pin(self, paths: list[str]) -> None:
        """Keep these files readable until ``release`` even if a concurrent overwrite deletes them (local disk:
        open descriptors outlive an unlink; elsewhere a no-op, and readers retry)."""

    def release(self) -> None: ...

    def file_size(self, path: str) -> int: ...

    def open_writer(self, path: str) -> FileWriter: ...

    def put_atomic(self, path: str, data: bytes) -> None: ...

    def remove_dir(self, path: str) -> None: ...

    def sync_dir(self, path: str) -> None: ...


def _missing(url: str, e: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{url}: file missing or unreadable ({e.__class__.__name__}: {e})")


class _LocalWriter:
    positional = True

    def __init__(self, path: str):
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0

    def write(self, data: memoryview) -> None:
        self.pwrite(data, self._pos)
        self._pos += data.nbytes

    def pwrite(self, data: memoryview, offset: int) -> None:
        data = data.cast("B")
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:done + _MAX_IO], offset + done)

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


class LocalStorage:
    """A directory on local disk."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._pinned: dict[str, int] = {}

    def url(self, path: str) -> str:
        return os.path.join(self.root, path)

    def exists(self, path: str) -> bool:
        return os.path.exists(self.url(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(self.url(path), "rb") as f:
                return f.read()
        except OSError as e:
            raise _missing(self.url(path), e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        url = self.url(path)
        out = out.cast("B")
        pinned = self._pinned.get(path)
        try:
            fd = os.open(url, os.O_RDONLY) if pinned is None else pinned
        except OSError as e:
            raise _missing(url, e) from e
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:done + _MAX_IO]], offset + done)
                if n == 0:
                    raise CorruptCheckpointError(f"{url}: file is truncated (wanted bytes up to "
                                                 f"{offset + len(out)}, it ends at {offset + done})")
                done += n
        finally:
            if pinned is None:
                os.close(fd)

    def pin(self, paths: list[str]) -> None:
        for path in paths:
            if path not in self._pinned:
                try:
                    self._pinned[path] = os.open(self.url(path), os.O_RDONLY)
                except OSError as e:
                    raise _missing(self.url(path), e) from e

    def release(self) -> None:
        for fd in self._pinned.values():
            os.close(fd)
        self._pinned.clear()

    def file_size(self, path: str) -> int:
        try:
            return os.stat(self.url(path)).st_size
        except OSError as e:
            raise _missing(self.url(path), e) from e

    def open_writer(self, path: str) -> _LocalWriter:
        os.makedirs(os.path.dirname(self.url(path)), exist_ok=True)
        return _LocalWriter(self.url(path))

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write to a temporary name, fsync, rename over ``path``, fsync the directory."""
        os.makedirs(self.root, exist_ok=True)
        tmp = self.url(f"{path}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            writer = _LocalWriter(tmp)
            writer.write(memoryview(data))
            writer.close()
            os.replace(tmp, self.url(path))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.sync_dir(os.path.dirname(path))

    def remove_dir(self, path: str) -> None:
        import shutil

        shutil.rmtree(self.url(path), ignore_errors=True)

    def sync_dir(self, path: str) -> None:
        fd = os.open(self.url(path) if path else self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _FsspecWriter:
    positional = False

    def __init__(self, fs, url: str):
        self._file = fs.open(url, "wb")

    def write(self, data: memoryview) -> None:
        self._file.write(data.cast("B"))

    def pwrite(self, data: memoryview, offset: int) -> None:
        raise NotImplementedError("object stores take sequential writes only")

    def close(self) -> None:
        self._file.close()  # an object store's upload completes (and is durable) on close


class FsspecStorage:
    """Any fsspec filesystem. Object stores get whole-object puts (atomic) and ranged GETs; no renames."""

    def __init__(self, fs, root: str, protocol: str):
        self.fs, self.root, self._protocol = fs, root.rstrip("/"), protocol

    def url(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def _display(self, path: str) -> str:
        return f"{self._protocol}://{self.url(path)}" if "://" not in self.root else self.url(path)

    def exists(self, path: str) -> bool:
        # Never answer from a listing cache: the manifest's existence is the commit point.
        self.fs.invalidate_cache(posixpath.dirname(self.url(path)))
        return self.fs.exists(self.url(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(self.url(path))
        except (OSError, KeyError) as e:
            raise _missing(self._display(path), e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        try:
            data = self.fs.cat_file(self.url(path), start=offset, end=offset + len(out))
        except (OSError, KeyError) as e:
            raise _missing(self._display(path), e) from e
        if len(data) != len(out):
            raise CorruptCheckpointError(f"{self._display(path)}: file is truncated (wanted {len(out)} bytes at "
                                         f"offset {offset}, got {len(data)})")
        out[:] = data

    def pin(self, paths: list[str]) -> None:
        pass

    def release(self) -> None:
        pass

    def file_size(self, path: str) -> int:
        self.fs.invalidate_cache(posixpath.dirname(self.url(path)))
        try:
            return int(self.fs.size(self.url(path)))
        except (OSError, KeyError) as e:
            raise _missing(self._display(path), e) from e

    def open_writer(self, path: str) -> _FsspecWriter:
        parent = posixpath.dirname(self.url(path))
        if parent and self._protocol not in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
            self.fs.makedirs(parent, exist_ok=True)
        return _FsspecWriter(self.fs, self.url(path))

    def put_atomic(self, path: str, data: bytes) -> None:
        # A single PUT of a whole object is atomic on object stores and on memory://.
        self.fs.pipe_file(self.url(path), data)

    def remove_dir(self, path: str) -> None:
        try:
            self.fs.rm(self.url(path), recursive=True)
        except (FileNotFoundError, KeyError):
            pass
        self.fs.invalidate_cache()

    def sync_dir(self, path: str) -> None:
        self.fs.invalidate_cache()


def open_storage(path: str | os.PathLike, storage_options: dict | None = None) -> Storage:
    """Local paths (and ``file://``) get the fast local backend; other URLs go through fsspec.

    ``storage_options`` go to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for s3fs).
    """
    path = os.fspath(path)
    if "://" not in path:
        return LocalStorage(path)
    if path.startswith("file://"):
        return LocalStorage(path[len("file://"):])
    try:
        import fsspec
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except ImportError as e:
        hint = "pip install 'shardckpt[s3]'" if path.startswith(("s3://", "s3a://")) else "pip install the fsspec backend"
        raise CheckpointError(f"cannot open {path}: {e}. Install the backend: {hint}") from e
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return FsspecStorage(fs, root, protocol)
