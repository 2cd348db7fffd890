"""Reading through a pooled (format v5) checkpoint's references (FORMAT.md, "Pooled checkpoints").

A v5 manifest's ``files`` are paths relative to the pool, ``<checkpoint's parent>/shardckpt-pool/``. ``files_view``
gives the readers one ``Storage`` in which the checkpoint reads as any other: paths under ``data-<generation>/``
go to the pool, every other path (the manifest) to the checkpoint's own directory. It checks first that the pool
beside the checkpoint is the one its manifest was written into (``pool.json``'s id). Nothing else in the read path
knows of pools: plans, ranged reads, block checks, pins and streaming work on the view as on a directory.
"""
from __future__ import annotations

from typing import Any

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.manifest import POOL_DIR, Manifest
from shardckpt.format.pool import POOL_JSON, PoolInfo, parse_pool_info
from shardckpt.io import Storage, lifecycle
from shardckpt.io.navigate import parent, sibling


def walkable(storage: Storage) -> Storage:
    """``storage`` (a pooled view: its checkpoint's directory), refused by name where its run directory cannot be
    found from it (a ``Storage`` the caller made)."""
    if isinstance(storage, PooledView):
        storage = storage.step
    if not isinstance(getattr(storage, "root", None), str):
        raise IncompatibleCheckpointError(f"{storage.url('')}: a pooled (incremental) checkpoint needs its run "
                                          "directory, and this Storage has no parent shardckpt can open; pass the "
                                          "checkpoint's path or URL instead")
    return storage


def pool_storage(storage: Storage) -> Storage:
    """The pool of the checkpoint (or run child) whose directory ``storage`` is."""
    return sibling(walkable(storage), POOL_DIR)


def run_storage(step: Storage) -> Storage:
    """The run directory: the parent of the checkpoint directory ``step``."""
    return parent(walkable(step))[0]


def read_pool_info(pool: Storage) -> PoolInfo | None:
    """The pool's ``pool.json``, or None where there is none."""
    if not pool.exists(POOL_JSON):
        return None
    return parse_pool_info(pool.read_bytes(POOL_JSON), pool.url(POOL_JSON))


def files_view(storage: Storage, manifest: Manifest) -> Storage:
    """Where ``manifest``'s files are read: ``storage`` itself, or for a pooled manifest a ``PooledView`` of it and
    its pool, once the pool's id is checked."""
    if manifest.pool is None or isinstance(storage, PooledView):
        return storage
    pool = pool_storage(storage)
    try:
        info = read_pool_info(pool)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{storage.url('')}: the pool beside this checkpoint is damaged ({e})") from None
    if info is None:
        raise CheckpointNotFoundError(f"{pool.url(POOL_JSON)}: this checkpoint keeps its data in the pool beside it, "
                                      "which is missing (a pooled step directory cannot be copied alone: `shardckpt "
                                      "convert` makes a standalone copy)")
    if info.id != manifest.pool["id"]:
        raise CorruptCheckpointError(f"{storage.url('')}: the pool beside this checkpoint ({pool.url('')}, id "
                                     f"{info.id}) is not the one it was written into (id {manifest.pool['id']})")
    return PooledView(storage, pool)


def _in_pool(path: str) -> bool:
    return path.startswith("data-")


class PooledView:
    """A checkpoint directory (``step``) whose ``data-*`` paths are its pool's (``pool``)."""

    def __init__(self, step: Storage, pool: Storage):
        self.step, self.pool = step, pool
        self.root = step.root

    def _for(self, path: str) -> Storage:
        return self.pool if _in_pool(path) else self.step

    def url(self, path: str) -> str:
        return self._for(path).url(path)

    def exists(self, path: str) -> bool:
        return self._for(path).exists(path)

    def read_bytes(self, path: str) -> bytes:
        return self._for(path).read_bytes(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._for(path).read_into(path, offset, out)

    def file_size(self, path: str) -> int:
        return self._for(path).file_size(path)

    def pin(self, paths: list[str]) -> None:
        lifecycle(self.pool).pin([p for p in paths if _in_pool(p)])
        try:
            lifecycle(self.step).pin([p for p in paths if not _in_pool(p)])
        except BaseException:
            lifecycle(self.pool).release()
            raise

    def release(self) -> None:
        lifecycle(self.pool).release()
        lifecycle(self.step).release()

    def stream(self, path: str, start: int, stop: int) -> Any:
        return self._for(path).stream(path, start, stop)

    def __getattr__(self, name: str) -> Any:  # listing, writing, holds: the checkpoint's own directory
        if name == "streams_whole_files":
            return getattr(self.pool, name, False)
        return getattr(self.step, name)
