"""``convert`` and ``export``: a checkpoint written anew, as ``shardckpt convert`` / ``export`` do.

Their options are their specs' fields (``offline.spec``: ``ConvertSpec``, ``ExportSpec``, each checked whole):
these functions take them as keywords, build the spec (``options.takes`` gives them its signature, which is also the
command's), pick the front door (this process or a process group: ``offline.convert``; local processes:
``offline.workers``) and turn the engine's report into the verb's result. The work is ``offline``'s (imported
when called)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from shardckpt.api.results import ConvertResult, ExportResult
from shardckpt.io import is_named, open_storage, where
from shardckpt.offline.spec import ConvertSpec, ExportSpec
from shardckpt.options import takes

log = logging.getLogger("shardckpt")
Progress = Callable[[int, int], None]  # progress(done_bytes, total_bytes)
PathLike = str | os.PathLike


@takes(ConvertSpec, progress=None, spread_over=None)
def convert(src: PathLike, dst: PathLike, *, progress: Progress | None = None, spread_over: Any = None,
            **options: Any) -> ConvertResult:
    """Write ``src`` (any readable checkpoint) as a shardckpt checkpoint at ``dst``: another world size, type
    or dtype; the same as ``shardckpt convert SRC DST``, whose options are these arguments. ``format="dcp"``
    writes a torch DCP checkpoint instead (SHARDED or FULL, one process, uncompressed).

    ``dst_storage_options``: the destination's fsspec options (default: ``storage_options``).
    ``progress(done_bytes, total_bytes)`` is called as this process writes. ``spread_over``: a process group
    whose ranks share the writing, each calling ``convert`` with the same arguments. ``files_per_rank``
    (default 2) and ``param_names``: see ``shardckpt.offline.spec.ConvertSpec``.

    >>> shardckpt.convert("runs/a/step-1000", "runs/a/step-1000-ws8", world_size=8)  # doctest: +SKIP
    ConvertResult(path='runs/a/step-1000-ws8', type='sharded', world_size=8, ...)
    >>> shardckpt.convert("runs/a/step-1000", "titan/checkpoint/step-1000", format="dcp",
    ...                   only=["model"], strip_prefix="model.")  # doctest: +SKIP
    """
    from shardckpt.errors import BadArgumentError

    start = time.monotonic()
    spec = ConvertSpec(src, dst, **options)
    if spec.workers != 1:
        if spread_over is not None:
            raise BadArgumentError(f"workers={spec.workers}: leave it out with spread_over= (the group's ranks are "
                                   "the workers)")
        from shardckpt.offline.workers import convert_in_workers

        report = convert_in_workers(spec, progress)
    else:
        from shardckpt.offline.convert import run

        report = run(spec, progress, spread_over)
    if report.kept_bytes:
        log.info("%s: resumed a killed conversion: kept %d bytes it had written (%d output ranks whole)", dst,
                 report.kept_bytes, len(report.kept_ranks))
    count = spread_over.size() if spread_over is not None else spec.workers
    return ConvertResult(where(dst), report.type, report.world_size, report.tensors, report.bytes_written,
                         report.kept_bytes, tuple(report.kept_ranks), count, time.monotonic() - start, spec.format)


@takes(ExportSpec, progress=None)
def export(src: PathLike, dst: PathLike, *, progress: Progress | None = None, **options: Any) -> ExportResult:
    """Write the model weights of ``src`` (any readable checkpoint) as Hugging Face style safetensors files in
    ``dst``; the same as ``shardckpt export SRC DST``. ``memory_limit`` (default: a 128 MiB slice buffer) bounds
    the process's resident memory. ``verify``: check the checksums the source stores as it is read.
    See ``shardckpt.offline.export`` for what is selected and how names are formed.

    >>> shardckpt.export("runs/a/step-1000", "hf/a", dtype="bfloat16").files  # doctest: +SKIP
    ('model.safetensors',)
    """
    import dataclasses

    from shardckpt.api.runs import explaining_run_dirs, resolve
    from shardckpt.offline.export import run

    start = time.monotonic()
    spec = ExportSpec(src, dst, **options)
    source = resolve(open_storage(spec.src, spec.storage_options), spec.latest)
    if spec.latest:  # a named source stays named (the spec's run opens it with its options, in any process)
        spec = dataclasses.replace(spec, src=where(source) if is_named(spec.src) else source, latest=False)
    with explaining_run_dirs(source):
        report = run(spec, progress)
    if report.kept:
        log.info("%s: resumed a killed export: kept %d finished files", dst, len(report.kept))
    return ExportResult(where(dst), tuple(report.files), report.tensors, report.total_size, report.dtype,
                        dict(report.tied), tuple(report.kept), time.monotonic() - start)
