"""Any fsspec filesystem (s3://, memory://, ...). Object stores get whole-object puts (atomic) and ranged
GETs; no renames."""
from __future__ import annotations

import posixpath
import time
from typing import Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.io.protocol import NO_LIFECYCLE, DirHold, missing


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



def _modified(info: dict) -> float | None:
    """An fsspec entry's modification time as seconds since the epoch (backends name it differently)."""
    value = info.get("LastModified", info.get("mtime", info.get("created")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


class FsspecStorage:
    """Any fsspec filesystem. Object stores get whole-object puts (atomic) and ranged GETs; no renames."""

    shown: str | None = None  # the URL it was opened by (``io.named``)

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
            raise missing(self._display(path), e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        try:
            data = self.fs.cat_file(self.url(path), start=offset, end=offset + len(out))
        except (OSError, KeyError) as e:
            raise missing(self._display(path), e) from e
        if len(data) != len(out):
            raise CorruptCheckpointError(f"{self._display(path)}: file is truncated (wanted {len(out)} bytes at "
                                         f"offset {offset}, got {len(data)})")
        out[:] = data

    def pin(self, paths: list[str]) -> None:
        pass

    def release(self) -> None:
        pass

    def is_dir(self, path: str = "") -> bool:
        self.fs.invalidate_cache(self.url(path))
        try:
            return bool(self.fs.isdir(self.url(path)))
        except (OSError, ValueError):
            return False

    def list_files(self, path: str = "") -> list[str]:
        return self._names(path, "file")

    def _names(self, path: str, kind: str) -> list[str]:
        """The names of the entries of ``kind`` ("file" or "directory") directly under ``path``, sorted."""
        self.fs.invalidate_cache(self.url(path))
        try:
            entries = self.fs.ls(self.url(path), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == kind)

    def listing(self, path: str = "") -> dict[str, tuple[int, float]]:
        """Every file below ``path``, recursively (relative to it), with its size and the seconds since its last
        write (the store's LastModified against this clock; one of unknown time counts as just written)."""
        base = self.url(path).rstrip("/")
        self.fs.invalidate_cache(base)
        try:
            infos = self.fs.find(base, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        now = time.time()
        found = {}
        for name, info in infos.items():
            name = name.rstrip("/")
            if info.get("type") == "file" and name.startswith(base + "/"):
                modified = _modified(info)
                age = 0.0 if modified is None else max(0.0, now - modified)
                found[name[len(base) + 1:]] = (int(info.get("size") or 0), age)
        return found

    def file_size(self, path: str) -> int:
        self.fs.invalidate_cache(posixpath.dirname(self.url(path)))
        try:
            return int(self.fs.size(self.url(path)))
        except (OSError, KeyError) as e:
            raise missing(self._display(path), e) from e

    def open_writer(self, path: str) -> _FsspecWriter:
        parent = posixpath.dirname(self.url(path))
        if parent and self._protocol not in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
            self.fs.makedirs(parent, exist_ok=True)
        return _FsspecWriter(self.fs, self.url(path))

    def put_atomic(self, path: str, data: bytes, exclusive: bool = False) -> None:
        # A single PUT of a whole object is atomic on object stores and on memory://; "create" is a
        # conditional PUT (If-None-Match: *) on S3, and raises FileExistsError where the object exists.
        try:
            self.fs.pipe_file(self.url(path), data, mode="create" if exclusive else "overwrite")
        except TypeError:  # a filesystem without modes: check, then put (not race-free there)
            if exclusive and self.exists(path):
                raise FileExistsError(self._display(path)) from None
            self.fs.pipe_file(self.url(path), data)

    def remove_dir(self, path: str) -> None:
        try:
            self.fs.rm(self.url(path), recursive=True)
        except (FileNotFoundError, KeyError):
            pass
        self.fs.invalidate_cache()

    def sync_dir(self, path: str) -> None:
        self.fs.invalidate_cache()

    def list_dirs(self, path: str = "") -> list[str]:
        return self._names(path, "directory")

    def hold_dir(self, path: str, exclusive: bool = False, wait: bool = False) -> DirHold:
        return NO_LIFECYCLE.hold_dir(path)  # object stores have no locks: remove_abandoned goes by age

    def remove_abandoned(self, path: str, min_age_s: float, dry_run: bool = False,
                         unused: Callable[[], bool] = lambda: True) -> bool:
        url = self.url(path)
        self.fs.invalidate_cache(url)
        is_dir = self.fs.isdir(url)
        try:
            infos = self.fs.find(url, detail=True) if is_dir else {url: self.fs.info(url)}
        except (FileNotFoundError, KeyError):
            return False
        times = [_modified(info) for info in infos.values()]
        if not times or None in times or time.time() - max(times) < min_age_s or not unused():
            return False  # too recent, of unknown age, or in use: a live writer may still need it
        if dry_run:
            return True
        if is_dir:
            self.remove_dir(path)
        else:
            self.fs.rm(url)
            self.fs.invalidate_cache()
        return True
