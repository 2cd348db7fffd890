"""``shardckpt verify DST [--against SRC]``: check an exported safetensors directory (or file).

Without ``against``: the structure. Every header parses within its file's bytes (``SafetensorsReader``);
with an index, every tensor of every ``*.safetensors`` file is in its ``weight_map``, every file it names
exists, no other shard file lies beside them, and ``metadata.total_size`` (where given) is the tensors' bytes.

With ``against``: also every value. The source is read as ``export`` reads it (``select``: the ``model``
entry, ``only``, ``strip_prefix``, wrapper prefixes removed, tied weights once) and compared with the export
by ``diff``, bit for bit, after casting each floating source tensor to the dtype the export holds: a cast
export is checked against the cast values. The floating tensors of an export must share one cast (or keep
their dtypes), as ``export`` writes them. Where the export's ``config.json`` ties weights (``export --config``,
``offline.hf_dir``; with transformers installed), a tied name left out is expected left out, and its source
values must equal those of the name written for it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from shardckpt.offline.diff import DiffReport, diff
from shardckpt.offline import hf_dir
from shardckpt.offline.export import SLICE_BYTES
from shardckpt.offline.export_plan import select
from shardckpt.offline.rename import Renames
from shardckpt.errors import CheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.formats.safetensors import SafetensorsReader
from shardckpt.formats.safetensors_header import INDEX_NAME, SUFFIX
from shardckpt.formats.local_view import logical_view
from shardckpt.io import Storage, where


@dataclass
class ExportCheck:
    files: int
    tensors: int
    bytes: int
    problems: list[str] = field(default_factory=list)
    values: DiffReport | None = None  # with ``against``

    @property
    def ok(self) -> bool:
        return not self.problems and (self.values is None or self.values.equal)


def verify_export(dst: str | os.PathLike | Storage, *, against: str | os.PathLike | Storage | None = None,
                  only: Sequence[str] | None = None, strip_prefix: str | None = None,
                  rename: Mapping[str, str | None] | None = None) -> ExportCheck:
    """Check the export at ``dst`` (see the module's docstring; a local path, or the place opened). Problems are
    collected, not raised; an unreadable export or source raises a ``CheckpointError`` naming the file."""
    reader = open_reader(dst)
    if not isinstance(reader, SafetensorsReader):
        raise CheckpointError(f"{where(dst)}: not a safetensors export (verify checks shardckpt checkpoints by their "
                              "own checksums; --against is for exports)")
    infos = reader.tensors()
    check = ExportCheck(len(reader.headers), len(infos), sum(h.size for h in reader.headers.values()),
                        _structure_problems(reader))
    if against is not None:
        source = logical_view(open_reader(against))
        expected = _ExpectedExport(source, only, strip_prefix, Renames(rename or {}), infos, _config_ties(reader))
        check.problems += expected.problems
        check.values = diff(expected, reader)
    return check


def _config_ties(reader: SafetensorsReader) -> dict[str, str]:
    """The tie pairs (left out -> written) the export's ``config.json`` ties, if it has one."""
    try:
        config = json.loads(reader.storage.read_bytes(hf_dir.CONFIG_NAME))
    except (CheckpointError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    try:
        pairs, ties, _ = hf_dir.declared_ties(config)
    except CheckpointError:  # a config transformers builds no model from: no ties to expect
        return {}
    return pairs if ties else {}


def _structure_problems(reader: SafetensorsReader) -> list[str]:
    if not reader.where.endswith(INDEX_NAME):
        return []  # one file, no index: its header was checked against its bytes when it was opened
    problems = []
    named = set(reader.tensors())
    for h in reader.headers.values():
        extra = sorted(set(h.tensors) - named)
        if extra:
            problems.append(f"{reader.storage.url(h.file)}: {len(extra)} tensors the index does not place here "
                            f"(first {extra[0]!r})")
    others = sorted(n for n in reader.storage.list_files() if n.endswith(SUFFIX) and n not in reader.headers)
    if others:
        problems.append(f"{reader.storage.root}: {len(others)} *{SUFFIX} files the index does not name "
                        f"(first {others[0]!r}): left from another export?")
    total = reader.index_metadata.get("total_size") if isinstance(reader.index_metadata, dict) else None
    want = sum(i.dtype.itemsize * math.prod(i.shape) for i in reader.tensors().values())
    if total is not None and total != want:  # optional: hand-made indexes may leave it out
        problems.append(f"{reader.where}: metadata.total_size is {total!r}, the tensors hold {want} bytes")
    return problems


class _ExpectedExport:
    """The source as ``export`` would write it: the selected tensors under their exported names, floating
    ones cast to the dtype the export holds (reads cast into the caller's buffer, as export's reads do)."""

    def __init__(self, source: CheckpointReader, only: Sequence[str] | None, strip_prefix: str | None,
                 rename: Renames, exported: Mapping[str, TensorInfo], ties: Mapping[str, str]):
        self.source = source  # (the export's __metadata__ is file metadata, which diff sets apart)
        chosen, _tied = select(source, only, strip_prefix, None, rename)
        by_name = {t.name: t for t in chosen}
        self.problems: list[str] = []
        for name, kept in ties.items():  # left out by the config's tie: its values must be the kept one's
            if name in by_name and kept in by_name and name not in exported:
                if not hf_dir.same_values(source, by_name[name], by_name[kept], SLICE_BYTES):
                    self.problems.append(f"{name}: left out as tied to {kept} by the export's config.json, but "
                                         "their values in the source differ")
                chosen.remove(by_name[name])
        casts = {exported[t.name].dtype for t in chosen
                 if t.name in exported and t.source_dtype.is_floating_point and exported[t.name].dtype != t.source_dtype}
        cast = casts.pop() if len(casts) == 1 else None
        self._source_of = {t.name: t.source.name for t in chosen}
        self._infos = {t.name: TensorInfo(t.name, cast if cast is not None and t.source_dtype.is_floating_point
                                          else t.source_dtype, t.shape, None) for t in chosen}

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def facts(self) -> Facts:
        return self.source.facts()

    def tree(self) -> Any:
        return {name: TensorRef(name) for name in self._infos}

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.source.read([ReadRequest(self._source_of[r.tensor], r.region, r.dest) for r in requests])

