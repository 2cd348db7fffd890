"""The byte-I/O protocol: everything the format and checkpoint layers need from where bytes live.

It is narrow on purpose, so that a new place (another object store, a peer over a socket, memory) is one
small class: ``Storage`` is bytes only (ranged reads into caller buffers, a streaming file writer, one atomic
whole-object put (the commit), existence and size checks, listing, deletion). What a store may do beyond bytes
(pins for readers, holds on directories being written, collection of debris, durable directories) is
``Lifecycle``, a protocol of its own: ``lifecycle(storage)`` is the storage where it implements it, else
no-ops. ``StreamingStorage`` is an optional fast path for object stores. Nothing relies on rename except the
local commit, where rename is atomic. Errors: a missing or short file raises
``CorruptCheckpointError`` naming its URL (``missing``).
"""
from __future__ import annotations

from typing import Callable, Protocol

from shardckpt.errors import CorruptCheckpointError

MAX_IO = 1 << 30  # bytes per read/write syscall; Linux caps one call just below 2 GiB


class FileWriter(Protocol):
    positional: bool
    """True: ``pwrite`` from several threads at once; False: ``write`` in order only (object uploads)."""

    def write(self, data: memoryview) -> None:
        """Append ``data`` at the end of what was written."""

    def pwrite(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` (only where ``positional``)."""

    def close(self) -> None:
        """Make the file durable (fsync on local disk, upload completes on object stores) and close it."""


class Storage(Protocol):
    """Bytes only: what every place where checkpoints live must do, and all that a new one must do (an in-memory
    store is ~60 lines, ``tests/storage/test_minimal_storage.py``). Where a store can do more for the lifecycle of
    what is written (pins, holds on directories being written, collection of debris, durable directories), it
    also implements ``Lifecycle``; ``lifecycle(storage)`` gives every caller one, no-ops for a store without."""

    root: str
    """The checkpoint directory or URL prefix; every ``path`` below is relative to it (``/``-separated)."""

    def url(self, path: str) -> str:
        """The absolute path or URL of ``path``, for messages."""

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists now, never from a cache (the manifest's existence is the commit point)."""

    def read_bytes(self, path: str) -> bytes:
        """The whole file."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` exactly with the file's bytes from ``offset``; a short file is corrupt."""

    def file_size(self, path: str) -> int:
        """The file's size in bytes, never from a cache."""

    def is_dir(self, path: str = "") -> bool:
        """Whether ``path`` (default: the root) is a directory, or on an object store a prefix with objects."""

    def list_files(self, path: str = "") -> list[str]:
        """Names of the files directly under ``path`` (default: the root), sorted; [] where there are none.
        Never from a cache that misses what was written or removed since."""

    def list_dirs(self, path: str = "") -> list[str]:
        """Names of the directories (object-store prefixes) directly under ``path``, sorted."""

    def open_writer(self, path: str) -> FileWriter:
        """A new file at ``path`` (parents created where the store has directories), replacing any old one."""

    def put_atomic(self, path: str, data: bytes, exclusive: bool = False) -> None:
        """Write a whole small file so that readers see the old one or the new one, never a part. With
        ``exclusive``, raise ``FileExistsError`` if ``path`` exists: of two exclusive puts racing for one
        path, exactly one succeeds (local: a hard link, which fails if the name exists; object stores: a
        conditional PUT, ``If-None-Match: *``)."""

    def remove_dir(self, path: str) -> None:
        """Delete ``path`` and everything under it; a missing one is not an error."""


class Lifecycle(Protocol):
    """What a store may do beyond bytes, for readers and writers that share it and for ``gc``. Local disk does
    it all; object stores pin and hold nothing (readers retry, ``gc`` goes by age); a bytes-only ``Storage``
    gets ``NoLifecycle`` from ``lifecycle``: nothing pinned or held, nothing collected, nothing to sync."""

    def pin(self, paths: list[str]) -> None:
        """Keep these files readable until ``release`` even if a concurrent overwrite deletes them (local disk:
        open descriptors outlive an unlink; elsewhere a no-op, and readers retry). Pins nest: concurrent
        readers each pin and release, and the files stay pinned until the last release."""

    def release(self) -> None:
        """End one ``pin`` (the files are let go when no pin is left)."""

    def hold_dir(self, path: str, exclusive: bool = False, wait: bool = False) -> DirHold:
        """Mark directory ``path`` (created if missing) as being written by this live process until
        ``release()``, so that ``remove_abandoned`` leaves it alone (local: a shared ``flock`` on it, which
        dies with the process; object stores: nothing, they go by age). ``exclusive``: and refuse to hold it
        while another process does, raising ``CheckpointError`` (local, where locks work; elsewhere as shared);
        ``wait``: wait for the other process instead of refusing."""

    def remove_abandoned(self, path: str, min_age_s: float, dry_run: bool = False,
                         unused: Callable[[], bool] = lambda: True) -> bool:
        """Remove file or directory ``path`` if no live writer can still be using it and ``unused()`` (asked
        last, under the lock where there is one: e.g. "no manifest names it now") is true, and say whether
        it was (or, ``dry_run``, would be) removed. Local: a directory or file nobody holds (an exclusive
        ``flock`` succeeds: files are held while ``open_writer`` writes them; where locks are unsupported,
        nothing is removed), a file only once older than ``min_age_s`` too.
        Object stores: anything whose newest object is older than ``min_age_s``."""

    def sync_dir(self, path: str) -> None:
        """Make the directory's entries durable (local fsync) and drop listing caches (fsspec)."""


class _NoHold:
    def release(self) -> None:
        pass


class NoLifecycle:
    """``Lifecycle`` for a bytes-only ``Storage``: nothing pinned (readers retry on a concurrent overwrite, as on
    object stores), nothing held, nothing ever collected (``gc`` cannot tell debris from a live writer's files
    there), nothing to sync."""

    def pin(self, paths: list[str]) -> None:
        pass

    def release(self) -> None:
        pass

    def hold_dir(self, path: str, exclusive: bool = False, wait: bool = False) -> DirHold:
        return _NoHold()

    def remove_abandoned(self, path: str, min_age_s: float, dry_run: bool = False,
                         unused: Callable[[], bool] = lambda: True) -> bool:
        return False

    def sync_dir(self, path: str) -> None:
        pass


NO_LIFECYCLE = NoLifecycle()
_LIFECYCLE = ("pin", "release", "hold_dir", "remove_abandoned", "sync_dir")


def lifecycle(storage: Storage) -> Lifecycle:
    """The storage's own ``Lifecycle`` where it implements one (every method of it), else ``NoLifecycle``."""
    return storage if all(callable(getattr(storage, m, None)) for m in _LIFECYCLE) else NO_LIFECYCLE


class StreamingStorage(Storage, Protocol):
    """Optional, for object stores where a few long GETs beat many short ranged ones (``io/s3.py``): a
    storage whose ``streams_whole_files`` is True has ``stream`` and ``stream_lanes``, and the native reader
    reads a file it needs (nearly) whole through up to ``stream_lanes`` streams at once, each over its own
    stretch of the file (``formats/native/lanes.py``); other storages are read by range."""

    streams_whole_files: bool
    stream_lanes: int
    """How many streams one load keeps open at once (S3: ``max_concurrency``)."""

    def stream(self, path: str, start: int, stop: int):
        """A context manager with ``read_into(path, offset, out)`` serving bytes ``[start, stop)`` of ``path``
        from one streaming GET, for reads in increasing offset order (others fall back to ranged reads)."""


class DirHold(Protocol):
    def release(self) -> None:
        """End the hold (idempotent)."""


def missing(url: str, e: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{url}: file missing or unreadable ({e.__class__.__name__}: {e})")
