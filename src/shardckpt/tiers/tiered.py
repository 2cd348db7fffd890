"""``TieredStorage``: one chosen step as a read-only ``Storage`` whose every file is read from where the restore
routed it (this node's tier 0, a peer's, or tier 2), the manifest served from the bytes every rank agreed on. It
records the files it was asked for, so that after a failed load the copies read can be checked and a bad one
excluded."""
from __future__ import annotations

import threading
from typing import Mapping

from shardckpt.errors import CheckpointError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.io import Storage


class TieredStorage:
    streams_whole_files = False

    def __init__(self, manifest: bytes, places: Mapping[str, Storage], label: str = "tiers"):
        """``places``: every data and index file's path -> the storage to read it from."""
        self._manifest, self._places = manifest, dict(places)
        self.root = f"{label}://"
        self.touched: set[str] = set()
        self._lock = threading.Lock()

    def _at(self, path: str) -> Storage:
        place = self._places.get(path)
        if place is None:
            from shardckpt.io.protocol import missing
            raise missing(self.url(path), FileNotFoundError("not routed"))
        with self._lock:
            self.touched.add(path)
        return place

    def url(self, path: str) -> str:
        place = self._places.get(path)
        return place.url(path) if place is not None else f"{self.root}{path}"

    def exists(self, path: str) -> bool:
        return path == MANIFEST_NAME or path in self._places

    def read_bytes(self, path: str) -> bytes:
        if path == MANIFEST_NAME:
            return self._manifest
        return self._at(path).read_bytes(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._at(path).read_into(path, offset, out)

    def file_size(self, path: str) -> int:
        if path == MANIFEST_NAME:
            return len(self._manifest)
        return self._at(path).file_size(path)

    def list_files(self, path: str = "") -> list[str]:
        names = {p[len(path):].lstrip("/") for p in [MANIFEST_NAME, *self._places] if p.startswith(path)}
        return sorted(n for n in names if n and "/" not in n)

    def list_dirs(self, path: str = "") -> list[str]:
        prefix = f"{path}/" if path else ""
        return sorted({p[len(prefix):].split("/")[0] for p in self._places if p.startswith(prefix) and
                       "/" in p[len(prefix):]})

    def is_dir(self, path: str = "") -> bool:
        return path == "" or bool(self.list_dirs(path) or self.list_files(path))

    def pin(self, paths: list[str]) -> None:
        pass

    def release(self) -> None:
        pass

    def _read_only(self, *args, **kwargs):
        raise CheckpointError("a restore's view of the tiers is read-only")

    open_writer = put_atomic = remove_dir = hold_dir = remove_abandoned = sync_dir = _read_only
