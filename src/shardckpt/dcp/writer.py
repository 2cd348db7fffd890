"""``StorageWriter``: torch DCP's ``dcp.save`` / ``dcp.async_save`` writing a shardckpt checkpoint.

DCP keeps its planners and its collectives; this class is the storage layer under them. Its steps, in DCP's
order (``torch/distributed/checkpoint/storage.py``):

- ``prepare_global_plan`` (rank 0): DCP's deduplicated plans become a shardckpt ``SavePlan`` (every write
  item one chunk of its tensor, written by the rank DCP chose; ``checkpoint.save_plan.make_save_plan`` checks
  that the chunks tile each tensor); each rank's write tasks travel in its plan's ``storage_data``;
- ``write_data`` (every rank): its chunks through ``checkpoint.writer.write_rank_files`` (block checksums,
  compression), its non-tensor values read back from DCP's bytes with ``torch.load(weights_only=True)``;
- ``finish`` (rank 0): the tree rebuilt from DCP's flattening (``Metadata.planner_data``), then
  ``checkpoint.save.commit``: the manifest last and atomically, created exclusively unless ``overwrite``.

What lands is a normal shardckpt checkpoint: ``verify``, ``load``, ``convert``, ``export``, ``diff`` read it.
"""
from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter, WriteResult
from torch.futures import Future

from shardckpt.checkpoint.collect import LocalPiece, region_key
from shardckpt.checkpoint.save import DEFAULT_FILES_PER_RANK, commit, data_dir
from shardckpt.checkpoint.save_plan import PieceInfo, SavePlan, WriteTask, make_save_plan
from shardckpt.checkpoint.stage import checked_metadata, host_tensor
from shardckpt.checkpoint.writer import RankResult, write_rank_files
from shardckpt.dcp.tree import TensorLeaf, nested_tree
from shardckpt.errors import CheckpointExistsError, UnsupportedValueError
from shardckpt.format.codecs import Compression
from shardckpt.format.dtypes import dtype_name
from shardckpt.format.manifest import MANIFEST_NAME, version_for
from shardckpt.format.tree import encode
from shardckpt.io import Storage, lifecycle, open_storage
from shardckpt.regions import Box, FlatRange, Region
from shardckpt.storage_options import Options

__all__ = ["StorageWriter"]


@dataclass(frozen=True)
class _RankTasks:
    """What rank 0 sends each rank in its plan's ``storage_data``."""

    generation: str
    tasks: list[WriteTask]
    files_per_rank: int
    compression: Compression | None
    version: int  # the format version the commit will write (the indexes must be written at it)


@dataclass(frozen=True)
class _Written:
    """A write result's ``storage_data``: the rank's files (on its first result) or a plain value."""

    rank_result: RankResult | None = None
    value: Any = None


class StorageWriter(_DcpStorageWriter):
    """Give it to ``dcp.save`` / ``dcp.async_save`` (``storage_writer=``) to write a shardckpt checkpoint at
    ``path`` (a local path or an fsspec URL, e.g. ``s3://bucket/run/step-100``).

    ``overwrite``: replace a committed checkpoint at ``path`` (readers see the old or the new one, never a
    mix); without it a save onto one is refused before anything is written, and of saves racing to one new
    path exactly one commits. ``compress``: ``"zstd"`` or ``"zstd:LEVEL"`` (as ``shardckpt.save``'s).
    ``files_per_rank``: data files each rank writes in parallel. ``metadata``: a JSON-able dict stored in the
    manifest (anything else, NaN too, is refused here with ``UnsupportedValueError``). A ``checkpoint_id`` given to ``dcp.save`` replaces ``path``.

    Non-tensor values are stored as shardckpt's plain JSON values (None, bool, int, float, str and lists,
    tuples and dicts of them): another object (e.g. ``bytes``) fails the save, naming its key.
    """

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, compress: str | None = None,
                 files_per_rank: int = DEFAULT_FILES_PER_RANK, storage_options: Options | None = None,
                 metadata: dict | None = None) -> None:
        super().__init__()
        if not isinstance(files_per_rank, int) or not 1 <= files_per_rank <= 64:
            raise ValueError(f"files_per_rank must be an int in 1..64, got {files_per_rank!r}")
        self.compression = Compression.parse(compress)
        self.path = os.fspath(path)
        self.overwrite, self.files_per_rank = overwrite, files_per_rank
        self.storage_options = storage_options
        self.metadata = checked_metadata(metadata, "StorageWriter(metadata=...)")  # before DCP writes any data
        self._storage: Storage | None = None
        self._save_plan: SavePlan | None = None
        self._holds: list = []
        self.rank, self.is_coordinator = 0, False

    # -- DCP's calls, in order -------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._release()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._storage, self._save_plan = None, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator, self.rank = is_coordinator, int(kwargs.get("rank", 0))
        self._storage = open_storage(self.path, self.storage_options)

    def prepare_local_plan(self, plan: DcpSavePlan) -> DcpSavePlan:
        return plan

    def prepare_global_plan(self, plans: list[DcpSavePlan]) -> list[DcpSavePlan]:
        """Rank 0: refuse an existing checkpoint (unless ``overwrite``), plan the chunks, give each rank its tasks."""
        storage = self._opened()
        if not self.overwrite and storage.exists(MANIFEST_NAME):
            raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a checkpoint already exists; pass "
                                        "StorageWriter(..., overwrite=True) to replace it")
        infos = [[_piece_info(item) for item in plan.items if item.type != WriteItemType.BYTE_IO]
                 for plan in plans]
        self._save_plan = make_save_plan(infos, uuid.uuid4().hex[:16], self.files_per_rank, self.compression)
        version = version_for(self.compression is not None, False, len(self._save_plan.tensors))
        return [replace(plan, storage_data=_RankTasks(self._save_plan.generation, self._save_plan.tasks[r],
                                                      self.files_per_rank, self.compression, version))
                for r, plan in enumerate(plans)]

    def write_data(self, plan: DcpSavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        mine: _RankTasks = plan.storage_data
        results, pieces = [], {}
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, 0, _Written(value=_plain_value(item.index.fqn, data))))
                continue
            piece = _local_piece(item, data)
            if piece.name in pieces:
                raise UnsupportedValueError(f"{piece.name!r}: this rank holds two shards of it (a ShardedTensor "
                                            "with several local shards); shardckpt's DCP writer takes one per rank")
            pieces[piece.name] = piece
            results.append(WriteResult(item.index, piece.data.nbytes, None))
        rank_result = None
        if mine.tasks:
            storage = self._opened()
            self._holds.append(lifecycle(storage).hold_dir(data_dir(mine.generation)))  # until the commit is decided
            try:
                rank_result = write_rank_files(storage, f"{data_dir(mine.generation)}/rank-{self.rank:05d}",
                                               mine.tasks, pieces, mine.files_per_rank, mine.compression,
                                               mine.version)
            except BaseException:
                self._release()  # DCP fails the save on every rank: the generation is debris for gc
                raise
        if results:
            results[0] = replace(results[0], storage_data=_Written(rank_result, _value_of(results[0])))
        elif rank_result is not None:
            raise UnsupportedValueError("a rank wrote tensor data but DCP gave it no write item to report it in")
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: rebuild the tree, then commit the manifest (``checkpoint.save.commit``)."""
        if self._save_plan is None:
            raise UnsupportedValueError("StorageWriter.finish without its prepare_global_plan: give dcp.save the "
                                        "writer on every rank, and use one writer per save at a time")
        rank_results, values = [], {}
        for rank_writes in results:
            first = rank_writes[0].storage_data if rank_writes else None
            rank_results.append(first.rank_result if isinstance(first, _Written) else None)
            for write in rank_writes:
                if isinstance(write.storage_data, _Written) and write.index.fqn not in self._save_plan.tensors:
                    values[write.index.fqn] = write.storage_data.value
        tree = nested_tree(metadata, values)
        encoded = encode(tree, lambda v: isinstance(v, TensorLeaf))
        try:
            commit(self._opened(), self._save_plan, self._save_plan.generation, rank_results, encoded,
                   self.metadata, self.overwrite)
        finally:
            self._release()
            self._save_plan = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    # -- helpers ---------------------------------------------------------------------------------------------

    def _opened(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.path, self.storage_options)
        return self._storage

    def _release(self) -> None:
        for hold in self._holds:
            hold.release()
        self._holds.clear()


def _region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Region:
    if any(s == 0 for s in sizes):
        return FlatRange(0, 0)
    return Box(tuple(offsets), tuple(sizes))


def _piece_info(item: Any) -> PieceInfo:
    td = item.tensor_data
    shape = tuple(td.size)
    region = _region(tuple(td.chunk.offsets), tuple(td.chunk.sizes))
    return PieceInfo(item.index.fqn, dtype_name(td.properties.dtype, item.index.fqn), shape,
                     region_key(region, shape), replicated=False, owner=True)


def _local_piece(item: Any, data: Any) -> LocalPiece:
    name, td = item.index.fqn, item.tensor_data
    if not isinstance(data, torch.Tensor):
        raise UnsupportedValueError(f"{name!r}: DCP's planner resolved a tensor item to {type(data).__name__}")
    host, _ = host_tensor(data)
    shape, sizes = tuple(td.size), tuple(td.chunk.sizes)
    region = _region(tuple(td.chunk.offsets), sizes)
    if isinstance(region, FlatRange):
        host = host.reshape(-1)[:0]
    return LocalPiece(name, host, shape, region, replicated=False)


def _plain_value(fqn: str, data: Any) -> Any:
    """A non-tensor value from DCP's bytes (``torch.save`` of it), read without unpickling code, and checked to
    be one shardckpt stores."""
    buf = data if isinstance(data, io.BytesIO) else io.BytesIO(bytes(data))
    buf.seek(0)
    try:
        value = torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means: not a plain value
        raise UnsupportedValueError(f"cannot save {fqn!r} through shardckpt's DCP writer: it is not a plain value "
                                    f"(None, bool, int, float, str, lists and dicts of them) ({e})") from None
    encode(value, lambda v: False, (fqn,))  # raises UnsupportedValueError naming the key
    return value


def _value_of(result: WriteResult) -> Any:
    return result.storage_data.value if isinstance(result.storage_data, _Written) else None
