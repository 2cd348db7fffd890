"""A third party's ``Storage``: bytes only (no ``Lifecycle``), in memory, in well under 100 lines, and every public
verb through it (save, load, load_full, verify, inspect, convert, diff, export's destination), given as the place
itself instead of a path."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import shardckpt
from shardckpt.errors import CorruptCheckpointError
from shardckpt.io import Storage, lifecycle
from shardckpt.io.protocol import NO_LIFECYCLE
from tests.checkpoint.cases import reference
from tests.storage._util import assert_tree_equal


class _Writer:
    positional = False  # in order only, as an upload

    def __init__(self, store: MemoryStorage, path: str):
        self.store, self.path, self.parts = store, path, []

    def write(self, data: memoryview) -> None:
        self.parts.append(bytes(data))

    def pwrite(self, data: memoryview, offset: int) -> None:  # pragma: no cover - not positional
        raise NotImplementedError

    def close(self) -> None:
        self.store.put_atomic(self.path, b"".join(self.parts))


class MemoryStorage:
    """Files in a dict shared by every ``MemoryStorage`` made from it, ``root`` a ``/``-separated prefix."""

    def __init__(self, files: dict[str, bytes] | None = None, root: str = "mem"):
        self.files = {} if files is None else files
        self.root = root
        self.lock = threading.Lock()

    def _key(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/")

    def url(self, path: str) -> str:
        return "memory-test://" + self._key(path)

    def exists(self, path: str) -> bool:
        return self._key(path) in self.files

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.files[self._key(path)]
        except KeyError:
            raise CorruptCheckpointError(f"{self.url(path)}: file missing") from None

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        data = self.read_bytes(path)[offset:offset + out.nbytes]
        if len(data) != out.nbytes:
            raise CorruptCheckpointError(f"{self.url(path)}: short file")
        out.cast("B")[:] = data

    def file_size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def _below(self, path: str) -> list[tuple[str, bool]]:
        prefix = self._key(path) + "/"
        rest = [k[len(prefix):] for k in list(self.files) if k.startswith(prefix)]
        return [(r.split("/")[0], "/" in r) for r in rest]

    def is_dir(self, path: str = "") -> bool:
        return bool(self._below(path))

    def list_files(self, path: str = "") -> list[str]:
        return sorted({name for name, deeper in self._below(path) if not deeper})

    def list_dirs(self, path: str = "") -> list[str]:
        return sorted({name for name, deeper in self._below(path) if deeper})

    def open_writer(self, path: str) -> _Writer:
        return _Writer(self, path)

    def put_atomic(self, path: str, data: bytes, exclusive: bool = False) -> None:
        with self.lock:
            if exclusive and self.exists(path):
                raise FileExistsError(self.url(path))
            self.files[self._key(path)] = bytes(data)

    def remove_dir(self, path: str) -> None:
        with self.lock:
            for key in [k for k in self.files if k.startswith(self._key(path) + "/")]:
                del self.files[key]


def test_a_bytes_only_storage_is_a_storage_without_a_lifecycle():
    storage = MemoryStorage()
    wanted = [m for m in vars(Storage) if not m.startswith("_") and callable(vars(Storage)[m])]
    assert sorted(wanted) == ["exists", "file_size", "is_dir", "list_dirs", "list_files", "open_writer", "put_atomic",
                              "read_bytes", "read_into", "remove_dir", "url"]
    assert all(callable(getattr(storage, m)) for m in wanted) and not hasattr(storage, "pin")
    assert lifecycle(storage) is NO_LIFECYCLE
    assert lifecycle(shardckpt.open_storage("/tmp")) is not NO_LIFECYCLE


def test_save_load_verify_inspect_through_a_memory_storage():
    files: dict[str, bytes] = {}
    ckpt = MemoryStorage(files, "run/step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated path taken
        shardckpt.save(reference(), ckpt)
    assert "run/step-1/manifest.json" in files
    assert_tree_equal(shardckpt.load_full(ckpt), reference())
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in reference()["model"].items()}
    shardckpt.load({"model": into}, ckpt, strict=False)
    assert_tree_equal(into, reference()["model"])
    result = shardckpt.verify(ckpt)
    assert result.ok and result.tensors > 0, result
    assert shardckpt.inspect(ckpt).tensors


def test_async_save_to_a_memory_storage():
    files: dict[str, bytes] = {}
    ckpt = MemoryStorage(files, "async")
    handle = shardckpt.async_save(reference(), ckpt)
    handle.wait()
    assert "memory-test://async" in handle.path
    assert_tree_equal(shardckpt.load_full(ckpt), reference())


def test_a_flipped_byte_in_a_memory_storage_is_found():
    files: dict[str, bytes] = {}
    ckpt = MemoryStorage(files, "c")
    shardckpt.save(reference(), ckpt)
    name = max((k for k in files if "/data-" in k), key=lambda k: len(files[k]))
    data = bytearray(files[name])
    data[len(data) // 2] ^= 0x10
    files[name] = bytes(data)
    assert not shardckpt.verify(ckpt).ok


def test_convert_and_diff_between_memory_storages(tmp_path):
    files: dict[str, bytes] = {}
    src, dst = MemoryStorage(files, "src"), MemoryStorage(files, "dst")
    shardckpt.save(reference(), src)
    shardckpt.convert(src, dst, world_size=3, compress="zstd")
    assert any(k.startswith("dst/") and k.endswith("manifest.json") for k in files)
    assert shardckpt.verify(dst).ok
    assert_tree_equal(shardckpt.load_full(dst), shardckpt.load_full(src))
    assert shardckpt.diff(src, dst).equal
    shardckpt.convert(src, str(tmp_path / "local"), world_size=2)  # and out to a path
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "local")), reference())


def test_gc_leaves_a_bytes_only_storage_alone():
    files: dict[str, bytes] = {}
    ckpt = MemoryStorage(files, "g")
    shardckpt.save(reference(), ckpt)
    before = dict(files)
    shardckpt.gc(ckpt)
    assert files == before
    with pytest.raises(Exception):
        shardckpt.latest(ckpt)
