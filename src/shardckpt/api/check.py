"""``verify``, ``diff`` and ``inspect``: what a checkpoint holds and whether it is sound, as ``shardckpt
verify`` / ``diff`` / ``inspect`` tell it. The work is ``checkpoint``'s and ``offline``'s (imported when
called); this module is their signature and their result."""
from __future__ import annotations

import os
import time
from typing import Annotated, Sequence

from shardckpt.api.results import DiffResult, Difference, InspectResult, Problem, VerifyResult
from shardckpt.api.runs import LATEST
from shardckpt.options import STORAGE, Opt, bounded_int, non_negative, prefixes
from shardckpt.offline.rename import read_rename_map
from shardckpt.api.transform import PathLike, Progress
from shardckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                              IncompatibleCheckpointError)

WITH_AGAINST = "with --against: what export was given"


def verify(
    path: Annotated[PathLike, Opt("checkpoint directory or fsspec URL")],
    *,
    against: Annotated[PathLike | None, Opt("PATH is an export: compare its every value with SRC's",
                                            metavar="SRC")] = None,
    only: Annotated[Sequence[str] | None, prefixes(WITH_AGAINST)] = None,
    strip_prefix: Annotated[str | None, Opt(WITH_AGAINST, metavar="P")] = None,
    rename_map: Annotated[dict | None, Opt(WITH_AGAINST + " (a JSON file; in Python the dict)", metavar="FILE",
                                           parse=read_rename_map)] = None,
    threads: Annotated[int | None, Opt("parallel reads (default: shardckpt.io's, 4)",
                                       parse=bounded_int(1, 256))] = None,
    storage_options: Annotated[dict | None, STORAGE] = None,
    progress: Progress | None = None,
) -> VerifyResult:
    """Check that the checkpoint at ``path`` is complete and uncorrupted (every byte against its checksums),
    or, for a safetensors export, its structure and with ``against`` its every value against the source's;
    the same as ``shardckpt verify PATH``. Problems are collected in the result (``ok`` False), not raised;
    a path that holds no checkpoint, or another format, raises a ``CheckpointError``.

    >>> shardckpt.verify("runs/a/step-1000").ok  # doctest: +SKIP
    True
    """
    from shardckpt.checkpoint.describe import foreign_format

    start = time.monotonic()
    other = foreign_format(path, storage_options=storage_options)
    if against is not None or (other is not None and other.startswith("safetensors")):
        result = _verify_export(path, against, only, strip_prefix, rename_map, storage_options)
    elif other is not None:
        raise IncompatibleCheckpointError(f"{path}: {other}, not a shardckpt checkpoint; verify checks shardckpt "
                                          "checkpoints against the checksums they store (inspect lists this one)")
    else:
        result = _verify_checkpoint(path, threads, storage_options, progress)
    return VerifyResult(**{**result, "seconds": time.monotonic() - start})


def _verify_checkpoint(path: PathLike, threads: int | None, storage_options: dict | None, progress) -> dict:
    from shardckpt.checkpoint.verify import verify as run_verify

    try:
        report = run_verify(path, storage_options=storage_options, progress=progress,
                            **({} if threads is None else {"io_threads": threads}))
    except CorruptCheckpointError as e:  # the manifest itself: nothing else can be checked
        return dict(path=os.fspath(path), ok=False, kind="checkpoint", tensors=0, tensor_bytes=0,
                    problems=(Problem(str(e)),))
    return dict(path=os.fspath(path), ok=report.ok, kind="checkpoint", tensors=report.tensors,
                tensor_bytes=report.bytes_checked, problems=tuple(Problem(p.message, p.tensor, p.file)
                                                                  for p in report.problems),
                version=report.version, manifest_checksum=report.manifest_checksum, chunks=report.chunks)


def _verify_export(path, against, only, strip_prefix, rename_map, storage_options) -> dict:
    from shardckpt.offline.verify_export import verify_export

    base = dict(path=os.fspath(path), kind="export", against=None if against is None else os.fspath(against))
    try:
        check = verify_export(path, against=against, only=only, strip_prefix=strip_prefix, rename=rename_map,
                              storage_options=storage_options, dst_storage_options=storage_options)
    except CheckpointError as e:  # an unreadable export or source: a failed check, named
        return dict(base, ok=False, tensors=0, tensor_bytes=0, problems=(Problem(str(e)),))
    values = check.values
    return dict(base, ok=check.ok, tensors=check.tensors, tensor_bytes=check.bytes, files=check.files,
                problems=tuple(Problem(p) for p in check.problems),
                differences=() if values is None else _differences(values))


def _differences(report, field: str = "differences") -> tuple[Difference, ...]:
    return tuple(Difference(d.name, d.kind, d.detail, d.max_abs_error) for d in getattr(report, field))


def diff(
    a: Annotated[PathLike, Opt("a checkpoint, file or fsspec URL (shardckpt, torch DCP, safetensors, "
                               "torch.save)")],
    b: Annotated[PathLike, Opt("the other one")],
    *,
    atol: Annotated[float, Opt("absolute tolerance for values (default 0: exact)", parse=non_negative)] = 0.0,
    rtol: Annotated[float, Opt("relative tolerance for values (default 0: exact)", parse=non_negative)] = 0.0,
    only: Annotated[Sequence[str] | None, prefixes("compare only the tensors and values under this dotted-name "
                                                    "prefix, on each side that has any (a side with none is "
                                                    "compared whole)")] = None,
    strip_prefix: Annotated[str | None, Opt("remove this prefix from the names that start with it (after "
                                            "--only), e.g. model. against an export", metavar="P")] = None,
    latest: Annotated[bool, Opt("A or B is a run directory: use the latest committed checkpoint below it "
                                "(`shardckpt ls` lists them)")] = False,
    read_all: Annotated[bool, Opt("compare every tensor by value, also where both sides store equal checksums "
                                  "(CRC32C: a collision is 1 in 2**32 by chance, and can be made)")] = False,
    storage_options: Annotated[dict | None, STORAGE] = None,
    progress: Progress | None = None,
) -> DiffResult:
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
    a, b = _sides(a, b, latest, storage_options)
    with explaining_run_dirs(storage_options, a, b):
        report = run_diff(a, b, atol=atol, rtol=rtol, only=only, strip_prefix=strip_prefix, read_all=read_all,
                          storage_options=storage_options, progress=progress)
    return DiffResult(os.fspath(a), os.fspath(b), report.equal, report.tensors, report.by_checksum,
                      report.bytes_read, report.plain_values, _differences(report), time.monotonic() - start,
                      _differences(report, "dtype_differences"), _differences(report, "metadata_differences"),
                      tuple(report.notes))


def _sides(a: PathLike, b: PathLike, latest: bool, storage_options: dict | None) -> tuple[str, str]:
    """A and B, with ``latest`` each run directory among them replaced by its latest committed checkpoint."""
    from shardckpt.api.runs import resolve

    sides = tuple(resolve(p, latest, storage_options, required=False) for p in (a, b))
    if latest and sides == (os.fspath(a), os.fspath(b)):
        raise CheckpointNotFoundError(f"latest=True: neither {os.fspath(a)} nor {os.fspath(b)} has a committed "
                                      "checkpoint below it")
    return sides


def inspect(
    path: Annotated[PathLike, Opt("checkpoint directory, file or fsspec URL")],
    *,
    latest: Annotated[bool, LATEST] = False,
    storage_options: Annotated[dict | None, STORAGE] = None,
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

    path = resolve(path, latest, storage_options)
    with explaining_run_dirs(storage_options, path):
        info = describe(path, storage_options=storage_options)
    if info["format"] == FORMAT_NAME:
        info["parameters"] = _by_parameter(path, storage_options)
    details = {k: v for k, v in info.items() if k not in ("path", "format", "tensors")}
    return InspectResult(os.fspath(path), info["format"], tuple(info["tensors"]), info["total_bytes"], details)


def _by_parameter(path: PathLike, options: dict | None) -> list[dict] | None:
    """A LOCAL checkpoint's tensors by parameter name, through its flat layouts (None: not LOCAL)."""
    from shardckpt.format.flat_layout import is_local
    from shardckpt.formats.detect import open_reader
    from shardckpt.formats.local_view import logical_view

    reader = open_reader(path, storage_options=options, verify=False)
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
