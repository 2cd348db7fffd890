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
    """The base of every verb's result: a frozen dataclass that ``to_json`` turns into ``--json``'s object."""

    def to_json(self) -> dict[str, Any]:
        """This result as ``--json`` prints it (one object; tuples as lists)."""
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Problem:
    """One thing ``verify`` found wrong; ``str()`` gives the tensor and file it concerns, then the message.

    :ivar message: what is wrong, and what to do where there is something to do.
    :ivar tensor: the tensor concerned, or None (a problem of a file or of the whole checkpoint).
    :ivar file: the file concerned (its URL), or None.
    """

    message: str
    tensor: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        where = " ".join(x for x in (f"tensor {self.tensor!r}" if self.tensor else "", self.file or "") if x)
        return f"{where}: {self.message}" if where else self.message


@dataclass(frozen=True)
class Difference:
    """One difference ``diff`` (or ``verify`` of an export against its source) found, by tensor or key.

    :ivar name: the tensor's or plain value's dotted name.
    :ivar kind: ``"only in A"``, ``"only in B"``, ``"shape"``, ``"dtype"``, ``"values"`` or ``"plain value"``.
    :ivar detail: what differs, in words (the two shapes, dtypes or values, how many elements).
    :ivar max_abs_error: for ``"values"``, the largest absolute difference of two elements; else None.
    """

    name: str
    kind: str
    detail: str
    max_abs_error: float | int | None = None


@dataclass(frozen=True)
class ConvertResult(Result):
    """What ``convert`` wrote.

    :ivar path: the checkpoint written.
    :ivar type: its state-dict type: ``"full"``, ``"sharded"`` or ``"local"``.
    :ivar world_size: the world size it was written for.
    :ivar tensors: the tensors it holds.
    :ivar tensor_bytes: the tensor bytes this process wrote (before compression).
    :ivar kept_bytes: of them, the bytes kept from a killed run of the same conversion (checked against
        their CRCs, not written again).
    :ivar kept_ranks: the output ranks that killed run had finished.
    :ivar workers: the processes that shared the writing.
    :ivar seconds: how long it took.
    :ivar format: what was written: ``"shardckpt"``, or ``"dcp"`` for a torch DCP directory.
    """

    path: str
    type: str
    world_size: int
    tensors: int
    tensor_bytes: int
    kept_bytes: int
    kept_ranks: tuple[int, ...]
    workers: int
    seconds: float
    format: str = "shardckpt"


@dataclass(frozen=True)
class ExportResult(Result):
    """What ``export`` wrote (a Hugging Face safetensors directory).

    :ivar path: the export's directory.
    :ivar files: the safetensors files, in order.
    :ivar tensors: the tensors written.
    :ivar tensor_bytes: the tensor bytes written (the index's ``metadata.total_size``).
    :ivar dtype: ``"keep"``, or the name of the dtype the floating-point tensors were cast to.
    :ivar tied: a tied weight not written -> the name it is written under (transformers ties it again).
    :ivar kept: the files of a killed export of the same source and plan, kept whole.
    :ivar seconds: how long it took.
    """

    path: str
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    dtype: str
    tied: dict[str, str]
    kept: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class VerifyResult(Result):
    """What ``verify`` found: ``ok`` when there is no problem. Some fields apply to one ``kind`` only (None
    for the other).

    :ivar path: what was checked.
    :ivar ok: no problem found (and, for an export with ``against``, no difference from the source).
    :ivar kind: ``"checkpoint"`` (a shardckpt checkpoint, by its checksums), ``"export"`` (safetensors) or ``"run"``
        (every checkpoint below a run directory).
    :ivar tensors: the tensors checked.
    :ivar tensor_bytes: the tensor bytes checked (a checkpoint: every byte read; an export: as its headers say).
    :ivar problems: what is wrong, each naming its tensor and file.
    :ivar version: a checkpoint's format version.
    :ivar manifest_checksum: a checkpoint's: False for format v1, whose manifest has no checksum to check.
    :ivar chunks: a checkpoint's chunks checked.
    :ivar files: an export's safetensors files.
    :ivar against: an export's: the source its values were compared with.
    :ivar differences: an export's with ``against``: the values that differ from the source's.
    :ivar sharing: a pooled (format v5) checkpoint's: ``total_bytes``, ``own_bytes`` (written by its own save),
        ``shared_bytes``, and ``shared``: per generation it reads, ``written_by`` (the step, or None if removed),
        ``bytes`` and ``also_used_by`` (the other steps that read them).
    :ivar checkpoints: a run directory's (``kind`` ``"run"``): per committed checkpoint below it,
        ``name``, ``ok``, ``problems`` (how many; each is in ``problems``, prefixed with its name), ``tensors``,
        ``chunks``; ``tensor_bytes`` is then the bytes read, each chunk of the pool once.
    :ivar digests_checked: with ``deep``: the pooled chunks whose content digest was compared with their bytes (a run
        directory's: counted per checkpoint, a shared chunk hashed once).
    :ivar seconds: how long it took.
    """

    path: str
    ok: bool
    kind: str
    tensors: int
    tensor_bytes: int
    problems: tuple[Problem, ...]
    version: int | None = None
    manifest_checksum: bool | None = None
    chunks: int | None = None
    files: int | None = None
    against: str | None = None
    differences: tuple[Difference, ...] = ()
    sharing: dict | None = None
    checkpoints: tuple[dict, ...] = ()
    digests_checked: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class DiffResult(Result):
    """What ``diff`` found between checkpoints ``a`` and ``b``: ``equal`` when nothing in ``differences``.

    :ivar a: the first checkpoint.
    :ivar b: the second.
    :ivar equal: no difference (dtype and metadata differences apart).
    :ivar tensors: the tensors compared (those both hold).
    :ivar by_checksum: of them, those settled by equal checksums, without reading.
    :ivar bytes_read: the tensor bytes read, both sides together.
    :ivar plain_values: the plain (non-tensor) values compared.
    :ivar differences: what makes them unequal.
    :ivar seconds: how long it took.
    :ivar dtype_differences: floating-point tensors of different dtypes whose values agree within the
        tolerance (they do not make the checkpoints unequal).
    :ivar metadata_differences: safetensors ``__metadata__`` differences (never make them unequal).
    :ivar notes: what was not compared, and what to try.
    """

    a: str
    b: str
    equal: bool
    tensors: int
    by_checksum: int
    bytes_read: int
    plain_values: int
    differences: tuple[Difference, ...]
    seconds: float
    dtype_differences: tuple[Difference, ...] = ()
    metadata_differences: tuple[Difference, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class InspectResult(Result):
    """What ``inspect`` read of a checkpoint in any format (nothing but headers and manifests). ``to_json``
    puts ``details``' keys beside the others.

    :ivar path: the checkpoint.
    :ivar format: its format (``"shardckpt"``, ``"safetensors"``, ``"torch DCP"``, ``"torch.save"``, ...).
    :ivar tensors: one dict per tensor: ``name``, ``dtype``, ``shape``, ``bytes`` (tensor bytes), ``crc32c``;
        shardckpt's own adds its chunks' codecs and more.
    :ivar tensor_bytes: the tensor bytes of them all.
    :ivar details: the rest of what the format tells (its version, world size, metadata, ...).
    """

    path: str
    format: str
    tensors: tuple[dict, ...]
    tensor_bytes: int
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        details = out.pop("details")
        return {**out, **{k: v for k, v in details.items() if k not in out}}


@dataclass(frozen=True)
class GcResult(Result):
    """What ``gc`` removed, or with ``dry_run`` would remove.

    :ivar path: the checkpoint or run directory collected.
    :ivar removed: the entries removed (with ``dry_run``: that would be removed), relative to ``path``.
    :ivar dry_run: whether nothing was removed, only listed.
    """

    path: str
    removed: tuple[str, ...]
    dry_run: bool


@dataclass(frozen=True)
class RmResult(Result):
    """The checkpoint ``rm`` removed.

    :ivar path: the path given.
    :ivar removed: the removed checkpoint's URL.
    """

    path: str
    removed: str


@dataclass(frozen=True)
class LatestResult(Result):
    """The latest committed checkpoint below a run directory; ``ok`` is False (the command exits 1) when there
    is none.

    :ivar run_dir: the run directory searched.
    :ivar latest: the committed checkpoint with the highest step, or None.
    """

    run_dir: str
    latest: str | None

    @property
    def ok(self) -> bool:
        """Whether there is a latest checkpoint (the command exits 1 when there is none)."""
        return self.latest is not None


@dataclass(frozen=True)
class LsResult(Result):
    """The checkpoints below a run directory, as ``ls`` lists them.

    :ivar path: the run directory.
    :ivar latest: the name of the latest committed checkpoint below it (what ``latest=True`` picks), or None.
    :ivar latest_path: its path, or None.
    :ivar checkpoints: one dict per checkpoint: ``name``, ``path``, ``step``, ``state``, ``format``,
        ``state_dict_type``, ``world_size``, ``file_bytes``, ...
    :ivar summary: one line: ``"3 checkpoints below (2 committed, 1 incomplete); the latest committed is ..."``.
    :ivar pool: the run's chunk pool (incremental saves), or None: ``path``, ``generations``, ``files``, ``bytes``,
        and ``unnamed_files`` / ``unnamed_bytes``, those no committed checkpoint names (``gc`` of the run removes
        them; None if a manifest could not be read); ``problem``: why ``pool.json`` could not be read (then the
        counts are 0 and None), else None.
    """

    path: str
    latest: str | None
    latest_path: str | None
    checkpoints: tuple[dict, ...]
    summary: str
    pool: dict | None = None
