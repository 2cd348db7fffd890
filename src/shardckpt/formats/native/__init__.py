"""shardckpt's own format (FORMAT.md) behind the read interface: a committed manifest and its data files.

``plan`` turns read requests into chunk reads (pure); ``reader`` executes them (indexes, ranged reads,
block checksums); ``flat_reads`` copies small tensors' flat ranges straight into one buffer (``formats.flat``).
The collective side (every rank on the same generation, retries after a concurrent overwrite) is
``checkpoint.load``'s.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointNotFoundError
from shardckpt.format.manifest import FORMAT_NAME, MANIFEST_NAME, Manifest, parse_manifest
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.flat import FlatRead, check_flat_reads
from shardckpt.formats.native.flat_reads import read_flat
from shardckpt.formats.native.plan import plan_reads
from shardckpt.formats.native.pool import files_view
from shardckpt.formats.native.reader import Indexes, check_stored, execute_reads
from shardckpt.formats.requests import check_requests
from shardckpt.io import DEFAULT_IO_THREADS, Storage


def read_manifest(storage: Storage) -> Manifest:
    url = storage.url(MANIFEST_NAME)
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(f"{url}: no committed checkpoint here (no {MANIFEST_NAME})")
    return parse_manifest(storage.read_bytes(MANIFEST_NAME), url)


class NativeReader:
    """A ``CheckpointReader`` over one committed generation (``manifest``) of a shardckpt checkpoint."""

    def __init__(self, storage: Storage, manifest: Manifest, *, io_threads: int = DEFAULT_IO_THREADS,
                 verify: bool = True):
        self.storage, self.manifest, self.io_threads, self.verify = storage, manifest, io_threads, verify
        self.storage = files_view(storage, manifest)  # a pooled (v5) checkpoint reads its files from its pool
        self.indexes = Indexes(self.storage, manifest)

    def tensors(self) -> Mapping[str, TensorInfo]:
        return {name: TensorInfo(name, e.dtype, e.shape, e.crc32c) for name, e in self.manifest.tensors.items()}

    def facts(self) -> Facts:
        m = self.manifest
        return Facts(FORMAT_NAME, self.storage.url(""), m.world_size, m.metadata.get("state_dict_type"), m.metadata,
                     f"shardckpt-generation:{m.generation}")

    def tree(self) -> Any:
        return self.manifest.tree

    def check_stored(self, names: Iterable[str]) -> None:
        """Before memory is allocated for tensors ``names``: the data files can hold them (``reader.check_stored``)."""
        check_stored(self.storage, self.manifest, names, self.indexes, self.io_threads)

    def read_flat(self, reads: Sequence[FlatRead], buffer: torch.Tensor) -> list[int]:
        """``formats.flat``'s fast path: the small tensors' reads straight into ``buffer``; the rest by position."""
        check_flat_reads(reads, buffer)  # (before any byte is copied to the addresses they name)
        return read_flat(self.storage, self.manifest, self.indexes, reads, buffer, self.verify, self.io_threads)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        targets = check_requests(self.manifest.tensors, requests, self.storage.url(MANIFEST_NAME))
        execute_reads(self.storage, self.manifest, plan_reads(targets), self.io_threads, self.verify, self.indexes)
