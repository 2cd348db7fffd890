"""``load`` (in place, any world size), ``load_pieces`` (callers' own requests) and ``load_full`` (a plain full
state dict, one process), for any format ``formats.detect.open_reader`` reads: the one load lane.

Each opens the checkpoint with ``checkpoint.lane.open_checkpoint`` (every rank on the same committed
generation) and runs ``lane.read_planned``: on every rank a plan (which reader, which requests, what to do once
they are read) is made and agreed (a refusal on any rank is raised on every rank before anything is read), the
requests are read, and the plan finished; after a concurrent overwrite the whole lane starts over on the new
generation. They differ only in their plan: ``load`` matches a state dict (``checkpoint.match``) through an
explicit reader view (``formats.local_view.by_parameter_unless_local``: a LOCAL checkpoint into a state dict that
is not LOCAL state reads by parameter), ``load_pieces`` asks its caller, ``load_full`` takes whole tensors
(``checkpoint.load_any``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

from shardckpt.checkpoint.lane import Plan, open_checkpoint, read_planned
from shardckpt.checkpoint.load_any import whole_plan
from shardckpt.checkpoint.match import match
from shardckpt.checkpoint.progress import ProgressCallback
from shardckpt.dist.group import LOCAL
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.formats.local_view import by_parameter_unless_local
from shardckpt.gc_pause import gc_paused
from shardckpt.io import DEFAULT_IO_THREADS, Storage
from shardckpt.storage_options import Options

# How a load sees a checkpoint's reader for a given target state dict (the reader itself where it does not apply).
ReaderView = Callable[[CheckpointReader, Any], CheckpointReader]


@gc_paused
def load(state_dict: dict, path: str | os.PathLike | Storage, *, process_group: Any = None, strict: bool = True,
         verify_checksums: bool = True, io_threads: int = DEFAULT_IO_THREADS,
         storage_options: Options | None = None, progress: ProgressCallback | None = None) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``, whatever world size and sharding wrote it.

    Called collectively on every rank. Each rank reads only the bytes its tensors need: plain tensors
    are filled whole, ``ShardedTensor``s and DTensors with their own region. Plain values are replaced
    by the saved ones. With ``strict``, missing or unexpected keys and shape or dtype mismatches raise
    ``IncompatibleCheckpointError`` before anything is read; otherwise the common keys load and dtypes
    are cast. ``verify_checksums`` checks every byte read against its CRC32C (a whole chunk's, or those of
    the checksum blocks around a partial read). ``progress(done_bytes, total_bytes)`` is told the bytes this
    rank has read into its tensors, after each batch of reads (it starts over if a concurrent overwrite makes
    the load retry). A LOCAL checkpoint loads into a state dict that is not LOCAL state by parameter name.
    """
    pinned = open_checkpoint(path, process_group=process_group, storage_options=storage_options,
                             io_threads=io_threads, verify=verify_checksums)
    read_planned(pinned, lambda reader: matched(reader, state_dict, strict, pinned.group.rank,
                                                view=by_parameter_unless_local), progress)


def matched(reader: CheckpointReader, state_dict: dict, strict: bool, rank: int, *,
            view: ReaderView | None) -> Plan:
    """``load``'s plan: ``state_dict`` matched to the checkpoint as ``view(reader, state_dict)`` presents it (None:
    as stored), its saved plain values and staged copies set once read."""
    seen = reader if view is None else view(reader, state_dict)
    found = match(seen.tree(), seen.tensors(), state_dict, strict, rank)
    return Plan(seen, found.requests, found.write_back)


def load_pieces(path: str | os.PathLike | Storage, build: Callable[[CheckpointReader], list[ReadRequest]], *,
                process_group: Any = None, verify_checksums: bool = True, io_threads: int = DEFAULT_IO_THREADS,
                storage_options: Options | None = None) -> CheckpointReader:
    """Collective, lower-level ``load``: ``build`` turns the checkpoint's reader (its ``tree()``, ``tensors()`` and
    ``facts()``) into explicit requests, made on every rank and agreed before any is read.

    Used where destinations are not a state dict's leaves, e.g. slices of a runtime flat shard filled
    straight from a checkpoint of any type. Returns the reader of the generation read (for its plain values).
    Dtypes are cast.
    """
    pinned = open_checkpoint(path, process_group=process_group, storage_options=storage_options,
                             io_threads=io_threads, verify=verify_checksums)
    return read_planned(pinned, lambda reader: Plan(reader, build(reader), lambda: reader))


@gc_paused
def load_full(path: str | os.PathLike | Storage, keys: Iterable[str] | None = None, *, verify_checksums: bool = True,
              io_threads: int = DEFAULT_IO_THREADS, storage_options: Options | None = None,
              progress: ProgressCallback | None = None) -> dict:
    """Read a checkpoint as a plain nested state dict of full CPU tensors, in this process alone.

    ``path`` (a local path or fsspec URL) holds any format ``formats.detect.open_reader`` reads: shardckpt's
    own (retried after a concurrent overwrite, the data files checked before anything is allocated), a
    safetensors file or Hugging Face directory, a torch DCP directory, or a ``torch.save`` file (read by
    ``checkpoint.load_any.whole_plan``: the tree with full tensors of the stored dtypes, plain values and
    containers as the reader gives them; a ``torch.save`` file of a list or of one tensor gives that).
    ``keys`` restricts it to entries whose dotted name equals a key or starts with ``key + "."`` (e.g.
    ``["model"]``); the result keeps the saved nesting. ``verify_checksums`` checks the checksums a format
    stores (shardckpt's CRC32Cs, each tensor's whole-tensor one included; the CRC-32 of DCP's archives). ``progress(done_bytes, total_bytes)``: as
    ``load``'s, the bytes of the selected tensors.
    """
    pinned = open_checkpoint(path, process_group=LOCAL, storage_options=storage_options, io_threads=io_threads,
                             verify=verify_checksums)
    return read_planned(pinned, lambda reader: whole_plan(reader, keys, pinned.check_stored), progress)
