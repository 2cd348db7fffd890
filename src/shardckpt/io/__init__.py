"""Where checkpoint bytes live: the byte-I/O protocol (``protocol.py``), local disk (``local.py``, the
fast path), any fsspec URL (``remote.py``), and S3 through s3fs at full speed with retries (``s3.py``)."""
from __future__ import annotations

import os

from shardckpt.errors import CheckpointError, StorageConfigError
from shardckpt.io.local import LocalStorage
from shardckpt.io.protocol import DirHold, FileWriter, Lifecycle, NoLifecycle, Storage, lifecycle
from shardckpt.io.remote import FsspecStorage
from shardckpt.io.s3 import S3Storage, S3Tuning
from shardckpt.storage_options import Options, StorageOptions, StorageTuning, as_storage_options

__all__ = ["DEFAULT_IO_THREADS", "DirHold", "FileWriter", "FsspecStorage", "Lifecycle", "LocalStorage", "NoLifecycle",
           "S3Storage", "Storage", "StorageOptions", "StorageTuning", "is_named", "lifecycle", "open_storage",
           "named", "opened_by_name", "split_url", "where"]

DEFAULT_IO_THREADS = 4  # concurrent reads per rank (load, verify)


def open_storage(path: str | os.PathLike | Storage,
                 storage_options: Options | None = None) -> Storage:
    """The one place where a checkpoint's place is opened: local paths (and ``file://``) get the fast local
    backend, other URLs go through fsspec, and a ``Storage`` (any object with the byte protocol) is the place
    itself, as given (its options were the opener's).

    ``storage_options``: a ``StorageOptions`` (the fsspec backend's keyword arguments, e.g.
    ``{"endpoint_url": ...}`` for s3fs, and shardckpt's typed ``StorageTuning``), or a plain dict of fsspec's
    options (``storage_options.as_storage_options``). A URL or options the backend does not accept (an unknown
    protocol, no bucket, an option of the wrong type) raise ``StorageConfigError`` here, before any read or write.
    """
    if not isinstance(path, (str, os.PathLike)):
        return path
    path = os.fspath(path)
    options = as_storage_options(storage_options)
    if "://" not in path or path.startswith("file://"):
        return named(LocalStorage(path[len("file://"):] if path.startswith("file://") else path), path)
    s3 = path.startswith(("s3://", "s3a://"))
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a dependency
        raise CheckpointError(f"cannot open {path}: {e}. Install the backend: pip install fsspec") from e
    try:
        tuning, kwargs = S3Tuning.resolve(options) if s3 else (None, dict(options.fsspec))
        fs, root = fsspec.core.url_to_fs(path, **kwargs)
        storage = _storage(fs, root, tuning)
        _check_options(storage, path)
    except ImportError as e:
        hint = "pip install 'shardckpt[s3]'" if s3 else "pip install the fsspec backend"
        raise CheckpointError(f"cannot open {path}: {e}. Install the backend: {hint}") from e
    except (CheckpointError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the backend says of the URL or the options
        raise StorageConfigError(f"cannot open {path}: {type(e).__name__}: {e}. Check the URL and the storage "
                                 f"options ({_option_names(options.fsspec)}; --storage-option KEY=VALUE)") from e
    return named(storage, path)


def named(storage: Storage, name: str) -> Storage:
    """``storage``, remembering the path or URL it was opened by (``shown``): what ``where`` says of it, so that
    messages and results name a place as the caller wrote it (``runs/a/step-000040``, not its absolute path)."""
    storage.shown = name
    return storage


def opened_by_name(place: Storage) -> bool:
    """Whether ``place`` was opened from a path or URL (``named``): such a place may be a run directory, looked
    below; a ``Storage`` the caller made is one checkpoint's place."""
    return getattr(place, "shown", None) is not None


def is_named(place: str | os.PathLike | Storage) -> bool:
    """Whether ``place`` is a path or URL (else a ``Storage``, the place itself)."""
    return isinstance(place, (str, os.PathLike))


def where(place: str | os.PathLike | Storage) -> str:
    """A path, URL or ``Storage`` as text, for messages and results."""
    if isinstance(place, (str, os.PathLike)):
        return os.fspath(place)
    if opened_by_name(place) and place.shown:
        return place.shown
    if isinstance(place, FsspecStorage):
        return place._display("")  # with its scheme: s3://bucket/prefix
    return place.url("").rstrip("/") or place.root


def _storage(fs, root: str, tuning: S3Tuning | None) -> Storage:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if tuning is not None and hasattr(fs, "_call_s3"):
        return S3Storage(fs, root, protocol, tuning)
    return FsspecStorage(fs, root, protocol)


def _check_options(storage: Storage, path: str) -> None:
    """Make the backend take its options now: s3fs builds its client (which checks every option and the
    credentials' shape, without a request); other backends answer one lookup of the root (an ``OSError``,
    such as a refused connection, is left for the real operation to report)."""
    if isinstance(storage, S3Storage):
        if not storage.root or storage.root.startswith("/"):
            raise StorageConfigError(f"{path}: no bucket in the URL; expected s3://BUCKET/PREFIX")
        storage.fs.connect()
        return
    try:
        storage.fs.exists(storage.root)
    except OSError:
        pass


def _option_names(options) -> str:
    return "given: " + ", ".join(sorted(map(str, options))) if options else "none given"


def split_url(path: str | os.PathLike) -> tuple[str, str]:
    """A file's path or URL as (its directory, its name), each usable with ``open_storage``."""
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        scheme, rest = path.split("://", 1)
        parent, _, name = rest.rstrip("/").rpartition("/")
        return f"{scheme}://{parent}", name
    local = os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)
    return os.path.dirname(local), os.path.basename(local)
