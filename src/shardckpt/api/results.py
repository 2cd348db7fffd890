"""What each verb returns: plain dataclasses, whose fields are also the keys of ``shardckpt VERB --json``
(``to_json``; docs/json.md is the schema, tests/cli/test_json.py holds the two together). Byte counts are
ints: ``tensor_bytes`` counts tensor data (elements x itemsize), ``file_bytes`` what the files take."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1  # raised when a key changes meaning or goes; new keys may appear within a version


@dataclass(frozen=True)
class Result:
    def to_json(self) -> dict[str, Any]:
        """This result as ``--json`` prints it (one object; tuples as lists)."""
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Problem:
    message: str
    tensor: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        where = " ".join(x for x in (f"tensor {self.tensor!r}" if self.tensor else "", self.file or "") if x)
        return f"{where}: {self.message}" if where else self.message


@dataclass(frozen=True)
class Difference:
    name: str
    kind: str  # "only in A", "only in B", "shape", "dtype", "values", "plain value"
    detail: str
    max_abs_error: float | int | None = None


@dataclass(frozen=True)
class ConvertResult(Result):
    path: str  # the checkpoint written
    type: str  # its state-dict type: "full", "sharded" or "local"
    world_size: int
    tensors: int
    tensor_bytes: int  # tensor bytes this process wrote (before compression)
    kept_bytes: int  # of them, kept from a killed run of the same conversion (checked against their CRCs)
    kept_ranks: tuple[int, ...]  # output ranks that killed run had finished
    workers: int  # processes that shared the writing
    seconds: float


@dataclass(frozen=True)
class ExportResult(Result):
    path: str  # the export's directory
    files: tuple[str, ...]  # the safetensors files, in order
    tensors: int  # tensors written
    tensor_bytes: int  # tensor bytes written (the index's metadata.total_size)
    dtype: str  # "keep" or the cast's name
    tied: dict[str, str]  # a tied weight not written -> the name it is written under (transformers re-ties it)
    kept: tuple[str, ...]  # files of a killed export of the same source and plan, kept whole
    seconds: float


@dataclass(frozen=True)
class VerifyResult(Result):
    path: str
    ok: bool
    kind: str  # "checkpoint" (a shardckpt checkpoint, by its checksums) or "export" (safetensors)
    tensors: int
    tensor_bytes: int  # tensor bytes checked (checkpoint: every byte read; export: as its headers say)
    problems: tuple[Problem, ...]
    version: int | None = None  # checkpoint: the format version
    manifest_checksum: bool | None = None  # checkpoint: False for format v1 (no manifest checksum to check)
    chunks: int | None = None  # checkpoint
    files: int | None = None  # export: safetensors files
    against: str | None = None  # export: the source its values were compared with
    differences: tuple[Difference, ...] = ()  # export with against: values that differ from the source's
    seconds: float = 0.0


@dataclass(frozen=True)
class DiffResult(Result):
    a: str
    b: str
    equal: bool
    tensors: int  # compared (held by both)
    by_checksum: int  # of them, settled by equal checksums without reading
    bytes_read: int  # tensor bytes read, both sides
    plain_values: int
    differences: tuple[Difference, ...]  # what makes them unequal
    seconds: float
    dtype_differences: tuple[Difference, ...] = ()  # floats of other dtypes compared within the tolerance
    metadata_differences: tuple[Difference, ...] = ()  # safetensors __metadata__: never makes them unequal
    notes: tuple[str, ...] = ()  # what was not compared, and what to try


@dataclass(frozen=True)
class InspectResult(Result):
    path: str
    format: str
    tensors: tuple[dict, ...]  # name, dtype, shape, bytes (tensor bytes), crc32c; shardckpt's own: codecs, ...
    tensor_bytes: int
    details: dict = field(default_factory=dict)  # the rest of what the format tells (version, world size, ...)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        details = out.pop("details")
        return {**out, **{k: v for k, v in details.items() if k not in out}}


@dataclass(frozen=True)
class GcResult(Result):
    path: str
    removed: tuple[str, ...]  # entries removed (with dry_run: that would be removed), relative to path
    dry_run: bool


@dataclass(frozen=True)
class LatestResult(Result):
    run_dir: str
    latest: str | None  # the committed checkpoint with the highest step, or None

    @property
    def ok(self) -> bool:  # the command exits 1 when there is none
        return self.latest is not None


@dataclass(frozen=True)
class LsResult(Result):
    path: str  # the run directory
    latest: str | None  # the name of the latest committed checkpoint below it (what latest=True picks)
    latest_path: str | None
    checkpoints: tuple[dict, ...]  # name, path, step, state, format, state_dict_type, world_size, file_bytes, ...
    summary: str  # "3 checkpoints below (2 committed, 1 incomplete); the latest committed is ..."
