"""``convert``: any checkpoint ``open_reader`` reads, written as a shardckpt checkpoint of another world size
or state-dict type, offline, without holding the model in memory: in one process, or spread over the
ranks of a process group (``spread_over``; ``torchrun ... -m shardckpt.cli.main convert``), on one machine
or several that see the same source and destination.

What is converted is decided first, before anything is written (``offline.conversion``). The source is
read through the read interface; a LOCAL shardckpt checkpoint through its flat layouts
(``formats.local_view``), so its parameters and optimizer state appear by name, padding never shows. The
output is planned as ``world_size`` ranks would save it (``checkpoint.save_plan``) and written rank by rank,
``files_per_rank`` writers at a time: each chunk is streamed, a slice at a time, from the source through the
cast (if asked) and the checksums into its file, so that memory stays within ``memory_limit``
(``offline.memory``: what the process holds already, plus the writers' slices), whatever the size. The
manifest is committed last, atomically: until then nothing at the destination loads or verifies, and a
committed checkpoint there is replaced only with ``overwrite``.

Resumable: the output's data directory is named by the source's identity and the options
(``offline.resume``), so a rerun of the same command after a kill keeps what the killed run had written of
each data file, as far as its bytes check against their block CRCs (read back), and writes the rest
(``offline.rank_files``; a shardckpt source only: other formats have no identity). Before the commit, each
tensor's checksum, combined from the output's chunks, must be the source's where the source records one and
the values are not cast: what is committed is what was read.

Spread over W workers, worker ``i`` writes the output ranks ``r`` with ``r % W == i`` (every worker plans
the same output; worker 0's generation names it), worker 0 gathers their results and commits, and every
worker raises the first worker's failure (nothing is committed then; what was written stays for a rerun).

Output types: FULL stores every tensor whole; SHARDED stores every tensor of one or more dimensions as
``world_size`` dim-0 chunks (``torch.chunk`` semantics, as ``get_state_dict(type=SHARDED)`` gives them)
and 0-d tensors whole. A FULL source converted to ``world_size > 1`` becomes SHARDED. LOCAL output (from a
LOCAL source only: it needs the source's flat layouts) is the checkpoint the job would have saved at
``world_size`` ranks: flat layouts re-derived, each flat tensor assembled from its members
(``offline.local_output``), everything else as stored.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardckpt.sizes import parse_size
from shardckpt.checkpoint.agree import encoded_holds_per_rank
from shardckpt.checkpoint.gc import committed_dir
from shardckpt.checkpoint.progress import Progress
from shardckpt.checkpoint.save import DEFAULT_FILES_PER_RANK, commit, data_dir
from shardckpt.checkpoint.save_plan import SavePlan
from shardckpt.checkpoint.writer import write_rank_files
from shardckpt.offline import adapters
from shardckpt.offline.conversion import (
    TYPES, Conversion, ConversionRequestError, Selection, check_world_size, conversion, key_type_of_option,
)
from shardckpt.offline.convert_plan import dim0_tiled, placement, plan_conversion
from shardckpt.offline.memory import DEFAULT_MEMORY_LIMIT, buffer_budget, read_reserve
from shardckpt.offline.rank_files import RankFiles
from shardckpt.offline.resume import conversion_generation, journal_dir
from shardckpt.offline.streams import ALIGN, Output, ReadOnDemand, SliceBuffers
from shardckpt.dist.group import LOCAL, Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.errors import BadArgumentError, CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardckpt.format.codecs import Compression
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import MANIFEST_NAME, version_for
from shardckpt.formats.detect import open_reader
from shardckpt.io import DirHold, Storage, open_storage
from shardckpt.formats.local_view import logical_view
from shardckpt.state_dict.types import OptimStateKeyType

__all__ = ["convert", "ConvertReport", "ConversionRequestError", "TYPES"]


@dataclass(frozen=True)
class ConvertReport:
    world_size: int
    type: str
    tensors: int
    bytes_written: int  # tensor bytes, as stored
    kept_ranks: tuple[int, ...] = ()  # output ranks a killed run of the same conversion had finished (this process's)
    kept_bytes: int = 0  # bytes of output a killed run had written, checked and kept (this process's)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, world_size: int | None = None,
            type: str | None = None, dtype: torch.dtype | None = None, only: Sequence[str] = (),
            exclude: Sequence[str] = (), strip_prefix: str | None = None, overwrite: bool = False,
            files_per_rank: int = DEFAULT_FILES_PER_RANK, param_names: Sequence[str] | None = None,
            storage_options: dict | None = None, dst_storage_options: dict | None = None, compress: str | None = None,
            progress: Callable[[int, int], None] | None = None, spread_over: Any = None,
            memory_limit: int | str | None = DEFAULT_MEMORY_LIMIT, optim_key: str | OptimStateKeyType | None = None,
            workers: int = 1, format: str = "shardckpt", adapter: str | None = None,
            reverse: bool = False) -> ConvertReport:
    """Convert the checkpoint at ``src`` (any readable format) into a shardckpt checkpoint at ``dst``.

    ``world_size``: of the output (default: the source's, 1 for formats that have none; at most the format's
    ``MAX_WORLD_SIZE``, 2**24). ``type``: "full",
    "sharded" or "local" (default: the source's; FULL at ``world_size > 1`` becomes SHARDED; "local" needs a
    LOCAL source). ``dtype``: cast floating-point tensors to it (not for LOCAL output). ``only`` /
    ``exclude``: dotted-name prefixes of the entries to keep / leave out (LOCAL output keeps the layouts).
    ``strip_prefix``: removed from the output names that start with it, the entries under it moved up to the root
    (``"model."`` makes ``{"model": sd}`` torchtitan's flat DCP keys); a name it would empty or make equal to
    another is refused.
    ``param_names``: for a LOCAL source, the unsharded model's parameter names in order (they number
    optimizer IDs as the job's FULL state dict would; see ``formats.local_view``). ``compress``: as
    ``shardckpt.save``'s (``"zstd"``, ``"zstd:LEVEL"``; default raw, whatever the source's codecs).
    ``progress(done_bytes, total_bytes)`` is called as this process writes (its share of the bytes).
    ``spread_over``: a process group whose ranks share the writing, each calling ``convert`` with the same
    arguments (collective); None: this process writes everything. ``memory_limit``: bytes (or ``"1GiB"``) this
    process's resident memory stays within, about (``offline.memory``); default None: 256 MiB of buffers on top of
    what the process holds. ``optim_key``: "name"
    or "id" (or an ``OptimStateKeyType``) keys the output's optimizer state (``optim``) that way (default: as
    the source keys it); IDs number the parameters as the job's FULL state dict does (``param_names``, else the
    order the source records, else its param groups'), ID-keyed groups record the names. ``workers``: local
    processes that share the writing (``offline.workers``; each within ``memory_limit``), instead of this one.
    ``format``: "shardckpt", or "dcp": a torch DCP directory (``offline.dcp_output``; SHARDED or FULL output,
    written by this process, uncompressed).
    ``adapter``: the source's model weights seen through a model family's adapter (``offline.adapters``; from
    HF's names and layouts when ``reverse``): the output then holds them only, as a FULL source would.
    """
    check_world_size(world_size)  # before any worker starts
    _check_format(format, type, workers, spread_over, compress)
    if workers != 1:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1 or spread_over is not None:
            raise ValueError(f"workers must be a positive int, without spread_over; got {workers!r}")
        from shardckpt.offline.workers import convert_in_workers

        return convert_in_workers(workers, progress, src, dst, dict(
            world_size=world_size, type=type, dtype=dtype, only=only, exclude=exclude, strip_prefix=strip_prefix,
            overwrite=overwrite, files_per_rank=files_per_rank, param_names=param_names, storage_options=storage_options,
            dst_storage_options=dst_storage_options, compress=compress, memory_limit=memory_limit,
            optim_key=optim_key, adapter=adapter, reverse=reverse))
    limit = None if memory_limit is None else parse_size(memory_limit)
    type = type or ("sharded" if format == "dcp" else None)  # DCP stores dim-0 chunks; a LOCAL source by parameter
    compression = Compression.parse(compress)
    source = open_reader(src, storage_options=storage_options)
    if adapter is not None or reverse:  # the model weights only, as a FULL source of them
        source = adapters.apply(logical_view(source, param_names=param_names), adapter, reverse)
    what = conversion(source, str(src), world_size, type, dtype, Selection(tuple(only), tuple(exclude), strip_prefix),
                      param_names, key_type_of_option(optim_key))
    stripped = {"strip_prefix": strip_prefix} if strip_prefix else {}  # resume identity; older runs' unchanged
    storage = open_storage(dst, dst_storage_options)
    if format == "dcp":
        return _write_dcp(what, storage, str(src), limit, progress, overwrite,
                          {"format": "dcp", "world": what.world, "type": what.out_type, "dtype": dtype,
                           "only": list(only), "exclude": list(exclude), "param_names": param_names,
                           "optim_key": None if what.key_type is None else what.key_type.value, **stripped})
    if not overwrite and storage.exists(MANIFEST_NAME):
        raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a checkpoint already exists; pass "
                                    "overwrite=True to replace it")
    shaping = {"world": what.world, "type": what.out_type, "dtype": dtype, "only": list(only),
               "exclude": list(exclude), "files_per_rank": files_per_rank, "compress": compress,
               "param_names": param_names, "optim_key": None if what.key_type is None else what.key_type.value,
               **({"adapter": adapter, "reverse": reverse} if adapter is not None else {}), **stripped}
    return _write_and_commit(what, storage, resolve_group(LOCAL if spread_over is None else spread_over), shaping,
                             compression, limit, progress, overwrite)


def _write_and_commit(what: Conversion, storage: Storage, workers: Group, shaping: dict,
                      compression: Compression | None, limit: int | None, progress: Callable[[int, int], None] | None,
                      overwrite: bool) -> ConvertReport:
    """Write this process's share of the output ranks (keeping what a killed run wrote and that checks), then
    commit: this process alone, or the workers' coordinator once every worker's share is written."""
    world, files_per_rank = what.world, shaping["files_per_rank"]
    place = functools.partial(placement, out_type=what.out_type, world=world, reader=what.reader)
    tiled = functools.partial(dim0_tiled, out_type=what.out_type, reader=what.reader)
    plan = plan_conversion(what.outputs, place, tiled, world, files_per_rank, compression,
                           workers.broadcast(conversion_generation(what.base, storage, shaping)))
    mine = [r for r in plan.tasks.writing_ranks() if r % workers.world_size == workers.rank]
    tick = Progress(sum(plan.tasks.bytes(r) for r in mine), progress)
    by_name = {o.name: o for o in what.outputs}
    kept, kept_bytes = [], [0]
    version = version_for(compression is not None, encoded_holds_per_rank(what.encoded_tree))  # v4: per-rank values
    budget = buffer_budget(limit, "convert", read_reserve(what.base, files_per_rank))
    buffers = SliceBuffers(files_per_rank, max(ALIGN, min(budget // files_per_rank, _largest_slice(what.outputs))))

    def write(r: int):
        pieces = ReadOnDemand(what.reader, by_name, functools.partial(place, rank=r), tick, buffers)
        files = RankFiles(storage, plan, pieces, buffers.take, tick, version)  # a killed run's: checked, kept
        result = write_rank_files(storage, f"{data_dir(plan.generation)}/rank-{r:05d}", plan.tasks[r], pieces,
                                  files_per_rank, compression, version=version, write_file=files.write)
        kept.extend([r] if files.whole else [])
        kept_bytes[0] += files.kept
        return result

    def commit_checked(results: list) -> None:
        raise_failures([r for r in results if isinstance(r, Failure)])  # what was written stays, for a rerun
        try:
            _check_against_source(plan, results, what.outputs)
        except CorruptCheckpointError:
            _remove_uncommitted(storage, plan.generation)  # else a rerun would keep what was wrong
            raise
        storage.remove_dir(journal_dir(plan.generation))
        commit(storage, plan, plan.generation, results, world, what.encoded_tree, what.metadata, overwrite)

    hold = _hold_output(storage, plan.generation, workers)
    try:
        if workers.world_size == 1:  # a failure (Ctrl-C, a full disk) keeps what was written: a rerun resumes it
            commit_checked([write(r) if r in mine else None for r in range(world)])
        else:
            shares = workers.gather(attempt(workers.rank, lambda: {r: write(r) for r in mine}))
            outcome = attempt(0, lambda: commit_checked(_in_rank_order(shares, world))) \
                if workers.is_coordinator else None
            raise_failures([workers.broadcast(outcome)])
    finally:
        if hold is not None:
            hold.release()
    written = sum(math.prod(o.source.shape) * itemsize(o.dtype) for o in what.outputs)
    return ConvertReport(world, what.out_type, len(what.outputs), written, tuple(kept), kept_bytes[0])


FORMATS = ("shardckpt", "dcp")  # output formats


def _check_format(format: str, type: str | None, workers: int, spread_over: Any, compress: str | None) -> None:
    if format not in FORMATS:
        raise BadArgumentError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "dcp" and (type == "local" or workers != 1 or spread_over is not None or compress is not None):
        raise BadArgumentError("format='dcp' writes SHARDED or FULL output from one process, uncompressed: "
                               "leave out type='local', compress= and workers= (and spread_over= in Python)")


def _write_dcp(what: Conversion, storage: Storage, src: str, limit: int | None,
               progress: Callable[[int, int], None] | None, overwrite: bool, shaping: dict) -> ConvertReport:
    """``what`` written as a torch DCP checkpoint (``offline.dcp_output``), resumable by ``shaping``'s generation."""
    from shardckpt.offline.dcp_output import write_dcp

    if what.out_type == "local":
        raise ConversionRequestError(f"{src}: a LOCAL source converts to DCP as type='sharded' or 'full'")
    place = functools.partial(placement, out_type=what.out_type, world=what.world, reader=what.reader)
    written = sum(math.prod(o.source.shape) * itemsize(o.dtype) for o in what.outputs)
    tick = Progress(written, progress)
    tick.begin()
    kept, kept_bytes = write_dcp(what, lambda o, rank: place(o, rank=rank), storage,
                                 conversion_generation(what.base, storage, shaping),
                                 min(buffer_budget(limit, "convert", read_reserve(what.base, 1)),
                                     _largest_slice(what.outputs)), tick, overwrite)
    return ConvertReport(what.world, what.out_type, len(what.outputs), written, tuple(kept), kept_bytes)


def _remove_uncommitted(storage: Storage, generation: str) -> None:
    """Remove the data directory of ``generation`` unless a committed manifest names it: a conversion's generation
    is the same for every run of it, and another run of the same command may have committed it meanwhile."""
    try:
        committed = committed_dir(storage)
    except CheckpointError:  # a manifest that cannot be read now: keep everything
        return
    if committed != data_dir(generation):
        storage.remove_dir(data_dir(generation))


def _hold_output(storage: Storage, generation: str, workers: Group) -> DirHold | None:
    """Worker 0 holds the output's data directory exclusively until the commit: gc leaves it alone, and a second
    run of the same conversion (the same directory, ``offline.resume``) fails at once rather than writing over
    this run's files. It then checks that no run committed that directory meanwhile."""
    def hold() -> DirHold:
        held = storage.hold_dir(data_dir(generation), exclusive=True)
        if committed_dir(storage) == data_dir(generation):
            held.release()
            raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: the same conversion was committed here "
                                        "meanwhile")
        return held

    if workers.world_size == 1:
        return hold()
    held = attempt(workers.rank, hold) if workers.is_coordinator else None
    raise_failures([workers.broadcast(held if isinstance(held, Failure) else None)])
    return held


def _check_against_source(plan: SavePlan, results: list, outputs: list[Output]) -> None:
    """Each output tensor's checksum (combined from its chunks' terms, as the commit does) is its source's, where
    the source records one and the values are not cast; else ``CorruptCheckpointError`` naming the tensor, before
    anything is committed (results that are failures are left to the commit, which raises them)."""
    if any(isinstance(r, Failure) for r in results):
        return
    for o in outputs:
        if o.source.crc32c is None or o.dtype != o.source.dtype:
            continue
        crc = functools.reduce(lambda acc, r: acc ^ (r.crc_terms.get(o.name, 0) if r is not None else 0), results, 0)
        if crc != o.source.crc32c and math.prod(o.source.shape):
            raise CorruptCheckpointError(f"{o.name}: the converted values' checksum {crc:08x} is not the source's "
                                         f"{o.source.crc32c:08x} (source tensor {o.source.name!r}); nothing was "
                                         "committed: run the conversion again")


def _in_rank_order(shares: list, world: int) -> list:
    """Every output rank's write result (None: nothing to write) from the workers' shares, or the workers'
    failures, which ``commit`` raises after removing the new files."""
    failures = [share for share in shares if isinstance(share, Failure)]
    if failures:
        return failures
    results: list = [None] * world
    for share in shares:
        for r, result in share.items():
            results[r] = result
    return results


def _largest_slice(outputs: list[Output]) -> int:
    """The most bytes one slice buffer can need: a whole output tensor, as read and as cast (a limit above
    that would only allocate what is never used: 64 GiB asked of a small checkpoint was 32 GiB allocated)."""
    return max((math.prod(o.source.shape) * (itemsize(o.source.dtype) + (itemsize(o.dtype) if o.dtype != o.source.dtype
                                                                          else 0)) for o in outputs), default=0) + ALIGN
