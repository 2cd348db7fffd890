"""Where checkpoint bytes live: the byte-I/O protocol (``protocol.py``), local disk (``local.py``, the
fast path), any fsspec URL (``remote.py``), and S3 through s3fs at full speed with retries (``s3.py``)."""
from __future__ import annotations

import os

from shardckpt.errors import CheckpointError
from shardckpt.io.local import LocalStorage
from shardckpt.io.protocol import DirHold, FileWriter, Storage
from shardckpt.io.remote import FsspecStorage
from shardckpt.io.s3 import S3Storage, S3Tuning

__all__ = ["DEFAULT_IO_THREADS", "DirHold", "FileWriter", "FsspecStorage", "LocalStorage", "S3Storage", "Storage", "open_storage", "split_url"]

DEFAULT_IO_THREADS = 4  # concurrent reads per rank (load, verify)


def open_storage(path: str | os.PathLike, storage_options: dict | None = None) -> Storage:
    """Local paths (and ``file://``) get the fast local backend; other URLs go through fsspec.

    ``storage_options`` go to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for s3fs).
    """
    path = os.fspath(path)
    options = dict(storage_options or {})
    if "://" not in path:
        return LocalStorage(path)
    if path.startswith("file://"):
        return LocalStorage(path[len("file://"):])
    try:
        import fsspec
        tuning = S3Tuning.take_from(options) if path.startswith(("s3://", "s3a://")) else None
        fs, root = fsspec.core.url_to_fs(path, **options)
    except ImportError as e:
        hint = "pip install 'shardckpt[s3]'" if path.startswith(("s3://", "s3a://")) else "pip install the fsspec backend"
        raise CheckpointError(f"cannot open {path}: {e}. Install the backend: {hint}") from e
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if tuning is not None and hasattr(fs, "_call_s3"):
        return S3Storage(fs, root, protocol, tuning)
    return FsspecStorage(fs, root, protocol)


def split_url(path: str | os.PathLike) -> tuple[str, str]:
    """A file's path or URL as (its directory, its name), each usable with ``open_storage``."""
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        scheme, rest = path.split("://", 1)
        parent, _, name = rest.rstrip("/").rpartition("/")
        return f"{scheme}://{parent}", name
    local = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
    return os.path.dirname(local), os.path.basename(local)
