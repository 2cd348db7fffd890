"""Places next to an opened place: the directory below it (``child``), the one above it (``parent``), the one beside
it (``sibling``), on the same store with the same options. This is what lets a verb open its place once, at the
edge, and walk a run directory, a checkpoint's pool or a file's directory from there, instead of carrying the path
and its ``storage_options`` down to be opened again.

A ``Storage`` whose ``root`` is not a path on its store (one the caller made with the byte protocol only) cannot be
walked from: that raises ``IncompatibleCheckpointError`` saying to pass a path or URL instead.
"""
from __future__ import annotations

import copy
import os
import posixpath

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.io.local import LocalStorage
from shardckpt.io import split_url, where
from shardckpt.io.s3 import S3Storage
from shardckpt.io.protocol import Storage


def child(storage: Storage, name: str) -> Storage:
    """The directory (prefix) ``name`` below ``storage``'s root."""
    if isinstance(storage, LocalStorage):
        below = LocalStorage(os.path.join(storage.root, name), storage.direct_io, storage.durable)
    else:
        below = _moved(storage, posixpath.join(_remote_root(storage), name))
    shown = getattr(storage, "shown", None)
    below.shown = None if not shown else \
        f"{shown.rstrip('/')}/{name}" if "://" in shown else os.path.join(shown, name)
    return below


def parent(storage: Storage) -> tuple[Storage, str]:
    """The directory (prefix) holding ``storage``'s root, and the root's name in it."""
    if isinstance(storage, LocalStorage):
        head, name = os.path.split(storage.root.rstrip(os.sep))
        above = LocalStorage(head or os.sep, storage.direct_io, storage.durable)
    else:
        head, name = posixpath.split(_remote_root(storage).rstrip("/"))
        if not head and isinstance(storage, S3Storage):  # s3://bucket: above it is the store's bucket list
            raise IncompatibleCheckpointError(
                f"{where(storage)}: a bucket's root has no directory above it (a run directory, a pool); put the "
                "checkpoint under a prefix, s3://bucket/run/step")
        above = _moved(storage, head)
    shown = getattr(storage, "shown", None)
    above.shown = split_url(shown)[0] if shown else None
    return above, name


def sibling(storage: Storage, name: str) -> Storage:
    """The directory (prefix) ``name`` beside ``storage``'s root."""
    return child(parent(storage)[0], name)


def name_of(storage: Storage) -> str:
    """The last component of ``storage``'s root (``step-000040`` for a checkpoint's directory)."""
    root = getattr(storage, "root", None)
    if not isinstance(root, str):
        return storage.url("").rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    return root.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]


def _remote_root(storage: Storage) -> str:
    if not isinstance(getattr(storage, "root", None), str):
        raise IncompatibleCheckpointError(
            f"{storage.url('')}: this needs the places around the checkpoint (its run directory, its pool or its "
            "file's directory), and this Storage has no root shardckpt can move from; pass a path or URL instead")
    return storage.root


def _moved(storage: Storage, root: str) -> Storage:
    """An fsspec storage (or another whose ``root`` is a path on its store): the same filesystem object and tuning,
    another root."""
    other = copy.copy(storage)
    other.root = root.rstrip("/")
    return other
