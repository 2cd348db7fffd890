"""``convert``: any checkpoint ``open_reader`` reads, written as a shardckpt checkpoint of another world size
or state-dict type, offline, without holding the model in memory: in this process, or spread over the
ranks of a process group (``spread_over``; ``torchrun ... -m shardckpt.cli.main convert``), on one machine
or several that see the same source and destination. Spread over local processes is another front door
(``offline.workers``, which ``shardckpt.convert(workers=N)`` and ``--workers N`` pick); this one never starts any.

The steps, the one write pipeline's: the spec (``offline.spec.ConvertSpec``: every option, checked), the source
opened (an adapter applied), the plan (``offline.convert_plan.plan_conversion``: pure, what is made of the source,
decided before anything is written), then ``checkpoint.persist`` with the output format's writer
(``offline.chunk_output`` for shardckpt's, ``offline.dcp_output`` for torch DCP's).

The source is read through the read interface; a LOCAL shardckpt checkpoint through its flat layouts
(``formats.local_view``), so its parameters and optimizer state appear by name, padding never shows. The
output is planned as ``world_size`` ranks would save it and written with every output rank's files at once,
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

Spread over W processes, process ``i`` writes the output ranks ``r`` with ``r % W == i`` (every process plans
the same output; process 0's generation names it), process 0 gathers their results and commits, and every
process raises the first one's failure (nothing is committed then; what was written stays for a rerun).

Output types: FULL stores every tensor whole; SHARDED stores every tensor of one or more dimensions as
``world_size`` dim-0 chunks (``torch.chunk`` semantics, as ``get_state_dict(type=SHARDED)`` gives them)
and 0-d tensors whole. A FULL source converted to ``world_size > 1`` becomes SHARDED. LOCAL output (from a
LOCAL source only: it needs the source's flat layouts) is the checkpoint the job would have saved at
``world_size`` ranks: flat layouts re-derived, each flat tensor assembled from its members
(``offline.local_output``), everything else as stored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from shardckpt.checkpoint.persist import persist
from shardckpt.dist.group import LOCAL, resolve_group
from shardckpt.errors import BadArgumentError, CheckpointExistsError
from shardckpt.format.manifest import MANIFEST_NAME, refuse_pool_dir
from shardckpt.formats.api import CheckpointReader
from shardckpt.formats.detect import open_reader
from shardckpt.io import Storage, open_storage
from shardckpt.offline import adapters
from shardckpt.offline.chunk_output import ConvertedChunks
from shardckpt.offline.convert_plan import plan_conversion
from shardckpt.offline.dcp_output import DcpOutput
from shardckpt.offline.resume import unused_generation
from shardckpt.offline.spec import ConvertSpec
from shardckpt.formats.local_view import logical_view
from shardckpt.gc_pause import gc_paused

__all__ = ["convert", "run", "open_source", "ConvertReport"]


@dataclass(frozen=True)
class ConvertReport:
    world_size: int
    type: str
    tensors: int
    bytes_written: int  # tensor bytes, as stored
    kept_ranks: tuple[int, ...] = ()  # output ranks a killed run of the same conversion had finished (this process's)
    kept_bytes: int = 0  # bytes of output a killed run had written, checked and kept (this process's)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None,
            spread_over: Any = None, **options: Any) -> ConvertReport:
    """Convert the checkpoint at ``src`` (any readable format) into a shardckpt checkpoint at ``dst``: ``run`` of
    ``ConvertSpec(src, dst, **options)`` (its fields are the options; ``offline.spec``)."""
    return run(ConvertSpec(src, dst, **options), progress, spread_over)


@gc_paused  # what the API, the command and each worker call
def run(spec: ConvertSpec, progress: Callable[[int, int], None] | None = None,
        spread_over: Any = None) -> ConvertReport:
    """The conversion ``spec`` asks for, written by this process, or shared with the ranks of ``spread_over`` (a
    process group whose every rank calls ``run`` with the same spec: collective).

    ``progress(done_bytes, total_bytes)`` is called as this process writes (its share of the bytes)."""
    if spec.workers != 1:
        raise BadArgumentError(f"workers={spec.workers}: local processes are another front door "
                               "(offline.workers.convert_in_workers; shardckpt.convert picks it)")
    if spec.format == "dcp" and spread_over is not None:
        raise BadArgumentError("format='dcp' writes from one process: leave out spread_over=")
    workers = resolve_group(LOCAL if spread_over is None else spread_over)
    plan = plan_conversion(open_source(spec), spec)
    storage = open_storage(spec.dst, spec.dst_storage_options)
    refuse_pool_dir(storage.url(""))
    if spec.format == "shardckpt":
        _refuse_existing(storage, spec)
    plan = plan.with_generation(workers.broadcast(unused_generation(storage, plan.generation)
                                                  if workers.is_coordinator else None))
    writer = DcpOutput(plan, storage, progress) if spec.format == "dcp" else \
        ConvertedChunks(plan, storage, workers, progress)
    persist(writer, workers)
    return ConvertReport(plan.what.world, plan.what.out_type, len(plan.what.outputs), plan.tensor_bytes,
                         writer.kept_ranks, writer.kept_bytes)


def open_source(spec: ConvertSpec) -> CheckpointReader:
    """The source as the conversion reads it: any format ``open_reader`` opens; with an adapter, the model weights
    only, as a FULL source of them (``offline.adapters``: its options may name a config file, read here)."""
    source = open_reader(spec.src, storage_options=spec.storage_options)
    if spec.adapter is not None:
        source = adapters.apply(logical_view(source, param_names=spec.param_names), spec.adapter, spec.reverse)
    return source


def _refuse_existing(storage: Storage, spec: ConvertSpec) -> None:
    if not spec.overwrite and storage.exists(MANIFEST_NAME):
        raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a checkpoint already exists; pass "
                                    "overwrite=True to replace it")
