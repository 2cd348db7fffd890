"""``verify``, ``diff`` and ``inspect``: what a checkpoint holds and whether it is sound, as ``shardckpt
verify`` / ``diff`` / ``inspect`` tell it. The work is ``checkpoint``'s and ``offline``'s (imported when
called); this module is their signature and their result."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Sequence

from shardckpt.api.results import DiffResult, Difference, InspectResult, Problem, VerifyResult
from shardckpt.api.runs import LATEST
from shardckpt.io import Storage, open_storage, where
from shardckpt.offline.spec import DiffSpec
from shardckpt.options import STORAGE, Opt, bounded_int, prefixes, takes
from shardckpt.offline.rename import read_rename_map
from shardckpt.api.transform import PathLike, Progress
from shardckpt.errors import (BadArgumentError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                              IncompatibleCheckpointError)
from shardckpt.storage_options import Options

WITH_AGAINST = "with --against: what export was given"


@dataclass(frozen=True)
class VerifySpec:
    """``shardckpt.verify``'s arguments (``shardckpt verify PATH``)."""

    path: Annotated[PathLike, Opt("checkpoint directory, run directory (every checkpoint below it) or fsspec URL")]
    against: Annotated[PathLike | None, Opt("PATH is an export: compare its every value with SRC's",
                                            metavar="SRC")] = None
    only: Annotated[Sequence[str] | None, prefixes(WITH_AGAINST)] = None
    strip_prefix: Annotated[str | None, Opt(WITH_AGAINST, metavar="P")] = None
    rename_map: Annotated[dict | None, Opt(WITH_AGAINST + " (a JSON file; in Python the dict)", metavar="FILE",
                                           parse=read_rename_map)] = None
    threads: Annotated[int | None, Opt("parallel reads (default: shardckpt.io's, 4)",
                                       parse=bounded_int(1, 256))] = None
    deep: Annotated[bool, Opt("also recompute each pooled chunk's content digest (incremental checkpoints; "
                              "needs blake3)")] = False
    storage_options: Annotated[Options | None, STORAGE] = None


@takes(VerifySpec, progress=None)
def verify(path: PathLike, *, progress: Progress | None = None, **options) -> VerifyResult:
    """Check that the checkpoint at ``path`` is complete and uncorrupted (every byte against its checksums),
    or, for a safetensors export, its structure and with ``against`` its every value against the source's, or, for
    a run directory, every checkpoint below it (each chunk of a run's pool read once); ``deep`` also hashes each
    pooled chunk with its pool's key and compares the digest its index records (``digests_checked`` counts them);
    the same as ``shardckpt verify PATH``. Problems are collected in the result (``ok`` False), not raised;
    a path that holds no checkpoint, or another format, raises a ``CheckpointError``.

    >>> shardckpt.verify("runs/a/step-1000").ok  # doctest: +SKIP
    True
    """
    spec = VerifySpec(path, **options)
    return _verify(spec, progress)


def _verify(spec: VerifySpec, progress: Progress | None) -> VerifyResult:
    from shardckpt.checkpoint.describe import foreign_format

    start = time.monotonic()
    place = open_storage(spec.path, spec.storage_options)
    if spec.deep and spec.against is not None:
        raise BadArgumentError("deep checks a shardckpt checkpoint's content digests; it does not apply to an export "
                               "checked against its source")
    if spec.against is None and _is_run_dir(place):
        return VerifyResult(**{**_verify_run(place, spec.threads, spec.deep), "seconds": time.monotonic() - start})
    other = foreign_format(place)
    if spec.deep and other is not None:
        raise BadArgumentError(f"{where(spec.path)}: {other}; deep checks a shardckpt checkpoint's content digests "
                               "(incremental checkpoints)")
    if spec.against is not None or (other is not None and other.startswith("safetensors")):
        source = None if spec.against is None else open_storage(spec.against, spec.storage_options)
        result = _verify_export(place, source, spec.only, spec.strip_prefix, spec.rename_map)
    elif other is not None:
        raise IncompatibleCheckpointError(f"{where(spec.path)}: {other}, not a shardckpt checkpoint; verify checks "
                                          "shardckpt "
                                          "checkpoints against the checksums they store (inspect lists this one)")
    else:
        result = _verify_checkpoint(spec.path, place, spec.threads, progress, spec.deep)
    return VerifyResult(**{**result, "seconds": time.monotonic() - start})


def _verify_checkpoint(path: PathLike | Storage, storage: Storage, threads: int | None, progress,
                       deep: bool = False) -> dict:
    """``path``'s checkpoint, opened once (``storage``), checked byte by byte."""
    from shardckpt.checkpoint.verify import verify as run_verify

    try:
        report = run_verify(storage, progress=progress, deep=deep,
                            **({} if threads is None else {"io_threads": threads}))
    except CorruptCheckpointError as e:  # the manifest itself: nothing else can be checked
        return dict(path=where(path), ok=False, kind="checkpoint", tensors=0, tensor_bytes=0,
                    problems=(Problem(str(e)),))
    return dict(path=where(path), ok=report.ok, kind="checkpoint", tensors=report.tensors,
                tensor_bytes=report.bytes_checked, problems=tuple(Problem(p.message, p.tensor, p.file)
                                                                  for p in report.problems),
                version=report.version, manifest_checksum=report.manifest_checksum, chunks=report.chunks,
                sharing=report.sharing, digests_checked=report.digests_checked)


def _is_run_dir(place: Storage) -> bool:
    """No checkpoint itself, checkpoints below it (``runs.run_dir_error``: only a place opened by path or URL)."""
    from shardckpt.checkpoint.runs import run_dir_error

    return run_dir_error(place) is not None


def _verify_run(run: Storage, threads: int | None, deep: bool = False) -> dict:
    """Every committed checkpoint below run directory ``run``, its pool's chunks read once (``verify_run``)."""
    from shardckpt.checkpoint.verify import verify_run

    found = verify_run(run, deep=deep, **({} if threads is None else {"io_threads": threads}))
    if not found:
        raise CheckpointNotFoundError(f"{where(run)}: no committed shardckpt checkpoint below it to verify")
    problems, steps, tensors, chunks, read, digests = [], [], 0, 0, 0, 0
    for name, report in found:
        if isinstance(report, CheckpointError):  # its manifest (or its pool) could not be read
            problems.append(Problem(f"{name}: {report}"))
            steps.append({"name": name, "ok": False, "problems": 1, "tensors": 0, "chunks": 0})
            continue
        problems += [Problem(f"{name}: {p.message}", p.tensor, p.file) for p in report.problems]
        steps.append({"name": name, "ok": report.ok, "problems": len(report.problems), "tensors": report.tensors,
                      "chunks": report.chunks})
        tensors, chunks, read = tensors + report.tensors, chunks + report.chunks, read + report.bytes_checked
        digests += report.digests_checked
    return dict(path=where(run), ok=not problems, kind="run", tensors=tensors, tensor_bytes=read,
                problems=tuple(problems), chunks=chunks, checkpoints=tuple(steps), digests_checked=digests)


def _verify_export(place: Storage, against: Storage | None, only, strip_prefix, rename_map) -> dict:
    from shardckpt.offline.verify_export import verify_export

    base = dict(path=where(place), kind="export", against=None if against is None else where(against))
    try:
        check = verify_export(place, against=against, only=only, strip_prefix=strip_prefix, rename=rename_map)
    except CheckpointError as e:  # an unreadable export or source: a failed check, named
        return dict(base, ok=False, tensors=0, tensor_bytes=0, problems=(Problem(str(e)),))
    values = check.values
    return dict(base, ok=check.ok, tensors=check.tensors, tensor_bytes=check.bytes, files=check.files,
                problems=tuple(Problem(p) for p in check.problems),
                differences=() if values is None else _differences(values))


def _differences(report, field: str = "differences") -> tuple[Difference, ...]:
    return tuple(Difference(d.name, d.kind, d.detail, d.max_abs_error) for d in getattr(report, field))


@takes(DiffSpec, progress=None)
def diff(a: PathLike, b: PathLike, *, progress: Progress | None = None, **options) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` (any readable formats) tensor by tensor, and their plain values;
    the same as ``shardckpt diff A B``. Differences are collected in the result (``equal`` False); with a
    tolerance, floating-point tensors of other dtypes are compared by value (``dtype_differences``); the
    ``__metadata__`` of safetensors files is reported apart (``metadata_differences``), never a difference;
    ``notes`` says what was not compared and what to try (a checkpoint against its export: ``only=["model"],
    strip_prefix="model."``). ``progress(done_bytes, total_bytes)`` is told the bytes read.

    >>> shardckpt.diff("runs/a/step-1000", "runs/a/step-1000-ws8").equal  # doctest: +SKIP
    True
    """
    from shardckpt.api.runs import explaining_run_dirs
    from shardckpt.offline.diff import diff as run_diff

    start = time.monotonic()
    spec = DiffSpec(a, b, **options)
    a, b = _sides(open_storage(a, spec.storage_options), open_storage(b, spec.storage_options), spec.latest)
    with explaining_run_dirs(a, b):
        report = run_diff(a, b, atol=spec.atol, rtol=spec.rtol, only=spec.only, strip_prefix=spec.strip_prefix,
                          read_all=spec.read_all, progress=progress)
    return DiffResult(where(a), where(b), report.equal, report.tensors, report.by_checksum,
                      report.bytes_read, report.plain_values, _differences(report), time.monotonic() - start,
                      _differences(report, "dtype_differences"), _differences(report, "metadata_differences"),
                      tuple(report.notes))


def _sides(a: Storage, b: Storage, latest: bool) -> tuple[Storage, Storage]:
    """A and B, with ``latest`` each run directory among them replaced by its latest committed checkpoint."""
    from shardckpt.api.runs import resolve

    sides = tuple(resolve(p, latest, required=False) for p in (a, b))
    if latest and sides == (a, b):
        raise CheckpointNotFoundError(f"latest=True: neither {where(a)} nor {where(b)} has a committed "
                                      "checkpoint below it")
    return sides


def inspect(
    path: Annotated[PathLike, Opt("checkpoint directory, file or fsspec URL")],
    *,
    latest: Annotated[bool, LATEST] = False,
    storage_options: Annotated[Options | None, STORAGE] = None,
) -> InspectResult:
    """What the checkpoint at ``path`` holds: its format, tensors (name, dtype, shape, tensor bytes,
    checksum) and, for shardckpt's own, world size, type and how it is stored; the same as ``shardckpt
    inspect PATH``. ``tensors`` are as stored; a LOCAL checkpoint's ``details["parameters"]`` lists it by
    parameter, through its flat layouts (None for other types).

    >>> shardckpt.inspect("runs/a/step-1000").details["world_size"]  # doctest: +SKIP
    2
    """
    from shardckpt.api.runs import explaining_run_dirs, resolve
    from shardckpt.checkpoint.describe import describe
    from shardckpt.format.manifest import FORMAT_NAME

    place = resolve(open_storage(path, storage_options), latest)
    with explaining_run_dirs(place):
        info = describe(place)
    if info["format"] == FORMAT_NAME:
        info["parameters"] = _by_parameter(place)
    details = {k: v for k, v in info.items() if k not in ("path", "format", "tensors")}
    return InspectResult(where(place), info["format"], tuple(info["tensors"]), info["total_bytes"], details)


def _by_parameter(place: Storage) -> list[dict] | None:
    """A LOCAL checkpoint's tensors by parameter name, through its flat layouts (None: not LOCAL)."""
    from shardckpt.format.flat_layout import is_local
    from shardckpt.formats.detect import open_reader
    from shardckpt.formats.local_view import logical_view

    reader = open_reader(place, verify=False)
    if not is_local(reader.tree()):
        return None
    view = logical_view(reader)
    return [{"name": t.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
             "bytes": t.dtype.itemsize * _numel(t.shape), "crc32c": None if t.crc32c is None else f"{t.crc32c:08x}"}
            for t in view.tensors().values()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
