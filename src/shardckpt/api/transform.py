"""``convert`` and ``export``: a checkpoint written anew, as ``shardckpt convert`` / ``export`` do.
The work is ``offline``'s (imported when called); this module is their signature and their result."""
from __future__ import annotations

import logging
import os
import time
from typing import Annotated, Any, Callable, Sequence

from shardckpt.api.results import ConvertResult, ExportResult
from shardckpt.options import STORAGE, Opt, positive_int, prefixes, size
from shardckpt.offline.rename import read_rename_map
from shardckpt.errors import BadArgumentError
from shardckpt.offline.memory import DEFAULT_MEMORY_LIMIT

log = logging.getLogger("shardckpt")
Progress = Callable[[int, int], None]  # progress(done_bytes, total_bytes)
TYPES = ("full", "sharded", "local")
FORMATS = ("shardckpt", "dcp")  # convert's output formats (offline.convert.FORMATS)
PathLike = str | os.PathLike

MEMORY_LIMIT = Opt("resident memory of this process at most about SIZE, e.g. 2GiB: what the process holds "
                   "already (~265 MiB of Python and torch) is spent first, the rest is the buffers data streams "
                   "through (default: no limit, fixed buffers: convert 256 MiB, export two of 64 MiB)", parse=size,
                   metavar="SIZE")
ADAPTER = Opt("read the model weights through a model family's adapter: its names and layouts mapped to Hugging "
              "Face's (torchtitan-llama, torchtitan-llama-0.2, phi3-fused, hf: as they are; or one registered with "
              "shardckpt.offline.adapters.register); options after a colon, e.g. torchtitan-llama:config=hf/config.json "
              "or torchtitan-llama:n_heads=32,n_kv_heads=8,tie_word_embeddings=true", metavar="NAME[:K=V,...]")
REVERSE = Opt("apply the adapter's inverse: from Hugging Face's names and layouts to the family's")


def _compression(text: str) -> str:
    from shardckpt.format.codecs import Compression  # torch: only when --compress is given

    Compression.parse(text)
    return text


def _float_dtype(name: str) -> str:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r}: expected a floating-point torch dtype, e.g. bfloat16")
    return name


CASTS = ("keep", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")


def _cast_name(text: str) -> str:
    name = text.removeprefix("torch.").lower()
    if name not in CASTS:
        raise ValueError(f"dtype {text!r}: expected one of keep, bfloat16, float16, float32 (or bf16, fp16, fp32)")
    return name


def convert(
    src: Annotated[PathLike, Opt("source checkpoint, file or fsspec URL")],
    dst: Annotated[PathLike, Opt("destination directory or fsspec URL")],
    *,
    world_size: Annotated[int | None, Opt("output world size (default: the source's, 1 for other formats)",
                                          parse=positive_int)] = None,
    type: Annotated[str | None, Opt("output state-dict type (default: the source's)", choices=TYPES)] = None,
    optim_key: Annotated[str | None, Opt("key the optimizer state by parameter name or ID (default: as the "
                                         "source does)", choices=("name", "id"))] = None,
    dtype: Annotated[str | None, Opt("cast floating-point tensors, e.g. bfloat16", parse=_float_dtype)] = None,
    only: Annotated[Sequence[str], prefixes("keep only this dotted-name prefix")] = (),
    exclude: Annotated[Sequence[str], prefixes("leave out this dotted-name prefix")] = (),
    strip_prefix: Annotated[str | None, Opt("remove this prefix from the output names, moving what is under it to "
                                            "the top, e.g. model. for torchtitan's flat DCP keys", metavar="P")] = None,
    compress: Annotated[str | None, Opt("store chunks as zstd frames (floats split into byte planes first); "
                                        "default: raw", parse=_compression, metavar="zstd[:LEVEL]")] = None,
    memory_limit: Annotated[int | str | None, MEMORY_LIMIT] = DEFAULT_MEMORY_LIMIT,
    workers: Annotated[int, Opt("spread the output files over N local processes (each within --memory-limit)",
                                parse=positive_int, metavar="N")] = 1,
    format: Annotated[str, Opt("write a shardckpt checkpoint (default) or a torch DCP directory (.metadata, "
                               "__R_0.distcp per output rank) that torch.distributed.checkpoint reads",
                               choices=FORMATS)] = "shardckpt",
    adapter: Annotated[str | None, ADAPTER] = None,
    reverse: Annotated[bool, REVERSE] = False,
    overwrite: Annotated[bool, Opt("replace a committed checkpoint at DST")] = False,
    storage_options: Annotated[dict | None, STORAGE] = None,
    dst_storage_options: dict | None = None,
    progress: Progress | None = None,
    spread_over: Any = None,
    files_per_rank: int | None = None,
    param_names: Sequence[str] | None = None,
) -> ConvertResult:
    """Write ``src`` (any readable checkpoint) as a shardckpt checkpoint at ``dst``: another world size, type
    or dtype; the same as ``shardckpt convert SRC DST``, whose options are these arguments. ``format="dcp"``
    writes a torch DCP checkpoint instead (SHARDED or FULL, one process, uncompressed).

    ``dst_storage_options``: the destination's fsspec options (default: ``storage_options``).
    ``progress(done_bytes, total_bytes)`` is called as this process writes. ``spread_over``: a process group
    whose ranks share the writing, each calling ``convert`` with the same arguments. ``files_per_rank``
    (default 2) and ``param_names``: see ``shardckpt.offline.convert.convert``.

    >>> shardckpt.convert("runs/a/step-1000", "runs/a/step-1000-ws8", world_size=8)  # doctest: +SKIP
    ConvertResult(path='runs/a/step-1000-ws8', type='sharded', world_size=8, ...)
    >>> shardckpt.convert("runs/a/step-1000", "titan/checkpoint/step-1000", format="dcp",
    ...                   only=["model"], strip_prefix="model.")  # doctest: +SKIP
    """
    from shardckpt.offline.convert import convert as run_convert

    start = time.monotonic()
    report = run_convert(src, dst, world_size=world_size, type=_lower(type), dtype=_torch_dtype(dtype),
                         only=tuple(only), exclude=tuple(exclude), strip_prefix=strip_prefix, overwrite=overwrite,
                         storage_options=storage_options, compress=compress, progress=progress,
                         dst_storage_options=storage_options if dst_storage_options is None else dst_storage_options,
                         spread_over=spread_over, memory_limit=memory_limit, optim_key=_lower(optim_key),
                         workers=workers, param_names=param_names, format=format, adapter=adapter, reverse=reverse,
                         **({} if files_per_rank is None else {"files_per_rank": files_per_rank}))
    if report.kept_bytes:
        log.info("%s: resumed a killed conversion: kept %d bytes it had written (%d output ranks whole)", dst,
                 report.kept_bytes, len(report.kept_ranks))
    count = spread_over.size() if spread_over is not None else workers
    return ConvertResult(os.fspath(dst), report.type, report.world_size, report.tensors, report.bytes_written,
                         report.kept_bytes, tuple(report.kept_ranks), count, time.monotonic() - start, format)


def export(
    src: Annotated[PathLike, Opt("source checkpoint, file or fsspec URL")],
    dst: Annotated[PathLike, Opt("destination directory or fsspec URL")],
    *,
    dtype: Annotated[str, Opt("bfloat16, float16, float32 or keep (default): cast floating-point tensors",
                              parse=_cast_name)] = "keep",
    max_shard_size: Annotated[int | str | None, Opt("tensor bytes per file at most, e.g. 500MiB (default: 5GB; "
                                                    "with --config, the installed transformers' save_pretrained "
                                                    "default)", parse=size, metavar="SIZE")] = None,
    config: Annotated[PathLike | None, Opt("write a complete model directory: config.json (dtype and tying made "
                                           "to match the weights, which are checked against it first) and the "
                                           "generation config and tokenizer files beside it, from this "
                                           "config.json, model directory or local Hugging Face cache snapshot",
                                           metavar="FILE_OR_DIR")] = None,
    only: Annotated[Sequence[str] | None, prefixes("export this dotted-name prefix instead of the model "
                                                    "weights")] = None,
    strip_prefix: Annotated[str | None, Opt("remove this prefix from the exported names", metavar="P")] = None,
    rename_map: Annotated[dict | None, Opt("rename the exported tensors: a JSON object of regular expressions -> "
                                           "new names (null: leave out); each name is renamed by the first "
                                           "pattern matching it whole (in Python: the dict)", metavar="FILE",
                                           parse=read_rename_map)] = None,
    adapter: Annotated[str | None, ADAPTER] = None,
    reverse: Annotated[bool, REVERSE] = False,
    memory_limit: Annotated[int | str | None, MEMORY_LIMIT] = None,
    latest: Annotated[bool, Opt("SRC is a run directory: use the latest committed checkpoint below it "
                                "(`shardckpt ls` lists them)")] = False,
    overwrite: Annotated[bool, Opt("replace an export at DST")] = False,
    storage_options: Annotated[dict | None, STORAGE] = None,
    dst_storage_options: dict | None = None,
    progress: Progress | None = None,
    verify: bool = True,
) -> ExportResult:
    """Write the model weights of ``src`` (any readable checkpoint) as Hugging Face style safetensors files in
    ``dst``; the same as ``shardckpt export SRC DST``. ``memory_limit`` (default: two 64 MiB buffers) bounds
    the process's resident memory. ``verify``: check the checksums the source stores as it is read.
    See ``shardckpt.offline.export`` for what is selected and how names are formed.

    >>> shardckpt.export("runs/a/step-1000", "hf/a", dtype="bfloat16").files  # doctest: +SKIP
    ('model.safetensors',)
    """
    from shardckpt.api.runs import explaining_run_dirs, resolve
    from shardckpt.offline.export import export as run_export, slice_bytes_for
    from shardckpt.sizes import parse_size

    start = time.monotonic()
    extra = {} if memory_limit is None else {"slice_bytes": slice_bytes_for(parse_size(memory_limit))}
    src = resolve(src, latest, storage_options)
    with explaining_run_dirs(storage_options, src):
        report = run_export(src, dst, dtype=dtype, max_shard_size=max_shard_size, only=only,
                            strip_prefix=strip_prefix, overwrite=overwrite, storage_options=storage_options,
                            progress=progress, rename=rename_map, verify=verify, config=config, adapter=adapter,
                            reverse=reverse, **extra,
                            dst_storage_options=storage_options if dst_storage_options is None else dst_storage_options)
    if report.kept:
        log.info("%s: resumed a killed export: kept %d finished files", dst, len(report.kept))
    return ExportResult(os.fspath(dst), tuple(report.files), report.tensors, report.total_size, report.dtype,
                        dict(report.tied), tuple(report.kept), time.monotonic() - start)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _torch_dtype(name: str | Any | None) -> Any:
    if not isinstance(name, str):
        return name  # None or a torch.dtype
    try:
        _float_dtype(name)
    except ValueError as e:
        raise BadArgumentError(str(e)) from None
    import torch

    return getattr(torch, name.removeprefix("torch."))
