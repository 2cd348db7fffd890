"""``shardckpt.load`` (in place, any world size) and ``load_full`` (a plain full state dict, one process, any
format ``formats.detect.open_reader`` reads; the foreign ones through ``checkpoint.load_any``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar


from shardckpt.dist.group import LOCAL, Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.checkpoint.load_any import load_reader, pick, tensor_refs, wanted_keys
from shardckpt.checkpoint.match import match
from shardckpt.checkpoint.progress import ProgressCallback, read_reporting
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format.manifest import (
    COMPRESSED_VERSION,
    MANIFEST_NAME,
    Manifest,
    chunks_of,
    min_stored_bytes,
    parse_manifest,
)
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import NativeReader, read_manifest
from shardckpt.formats.native.reader import check_data_file, read_index, record_problem
from shardckpt.io import DEFAULT_IO_THREADS, Storage, open_storage

T = TypeVar("T")
_ATTEMPTS = 5  # a concurrent overwrite can remove the data a reader is on; it then reloads the new checkpoint

# Views a higher layer puts over a checkpoint's reader for a given target state dict, in order: state_dict
# registers the by-parameter view of a LOCAL checkpoint, for targets that are not LOCAL state themselves.
_READER_VIEWS: list[Callable[[CheckpointReader, dict], CheckpointReader]] = []


def register_reader_view(view: Callable[[CheckpointReader, dict], CheckpointReader]) -> None:
    """Have ``load`` read through ``view(reader, state_dict)`` (which returns ``reader`` when it does not apply)."""
    if view not in _READER_VIEWS:
        _READER_VIEWS.append(view)


def load(state_dict: dict, path: str | os.PathLike, *, process_group: Any = None, strict: bool = True,
         verify_checksums: bool = True, io_threads: int = DEFAULT_IO_THREADS,
         storage_options: dict | None = None, progress: ProgressCallback | None = None) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``, whatever world size and sharding wrote it.

    Called collectively on every rank. Each rank reads only the bytes its tensors need: plain tensors
    are filled whole, ``ShardedTensor``s and DTensors with their own region. Plain values are replaced
    by the saved ones. With ``strict``, missing or unexpected keys and shape or dtype mismatches raise
    ``IncompatibleCheckpointError`` before anything is read; otherwise the common keys load and dtypes
    are cast. ``verify_checksums`` checks every byte read against its CRC32C (a whole chunk's, or those of
    the checksum blocks around a partial read). ``progress(done_bytes, total_bytes)`` is told the bytes this
    rank has read into its tensors, after each batch of reads (it starts over if a concurrent overwrite makes
    the load retry).
    """
    group, storage = resolve_group(process_group), open_storage(path, storage_options)
    if not _is_native(group, storage):
        reader = agreed(group, lambda: open_reader(path, storage_options=storage_options, io_threads=io_threads,
                                                   verify=verify_checksums))
        if not isinstance(reader, NativeReader):  # (a native one: a manifest committed since; the path below)
            raise_failures(group.all_gather(attempt(group.rank, lambda: _load_from(reader, state_dict, strict,
                                                                                   group, progress))))
            return
    _with_retries(group, storage, lambda storage, manifest: _load_from(
        NativeReader(storage, manifest, io_threads=io_threads, verify=verify_checksums), state_dict, strict, group,
        progress))


def agreed(group: Group, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank, then its outcome agreed: if it raised on any rank, every rank raises that
    (before any rank goes on, e.g. to read into its targets: a refusal leaves every rank's targets as they were)."""
    outcome = attempt(group.rank, fn)
    raise_failures(group.all_gather(outcome if isinstance(outcome, Failure) else None))
    return outcome


def _is_native(group: Group, storage: Storage) -> bool:
    """Whether ``storage`` holds shardckpt's own format, as rank 0 sees it (every rank takes the same path)."""
    mine = attempt(group.rank, lambda: storage.exists(MANIFEST_NAME)) if group.is_coordinator else None
    seen = group.broadcast(mine)
    raise_failures([seen])
    return seen


def _with_retries(group: Group, storage: Storage, work: Callable[[Storage, Manifest], T]) -> T:
    """Run ``work`` on the committed manifest; start over if a concurrent overwrite removed its data."""
    for attempt_no in range(_ATTEMPTS):
        manifest = _shared_manifest(group, storage)
        outcome = attempt(group.rank, lambda m=manifest: work(storage, m))
        outcomes = group.all_gather(outcome)
        if not any(isinstance(o, Failure) for o in outcomes):
            return outcome
        if attempt_no + 1 < _ATTEMPTS and _generation_changed(group, storage, manifest):
            continue
        raise_failures(outcomes)


@dataclass(frozen=True)
class ReaderContents:
    """What ``load_pieces`` shows ``build`` of a checkpoint in another format: what a ``Manifest`` shows of
    shardckpt's own (its tree, its tensors' shapes and dtypes by name, its metadata: none)."""

    tree: Any
    tensors: Mapping[str, TensorInfo]
    metadata: dict = field(default_factory=dict)


def load_pieces(path: str | os.PathLike, build: Callable[[Manifest | ReaderContents], list[ReadRequest]], *,
                process_group: Any = None, verify_checksums: bool = True, io_threads: int = DEFAULT_IO_THREADS,
                storage_options: dict | None = None) -> Manifest | ReaderContents:
    """Collective, lower-level ``load``: ``build`` turns the committed manifest into explicit requests.

    Used where destinations are not a state dict's leaves, e.g. slices of a runtime flat shard filled
    straight from a checkpoint of any type. Returns the manifest (for its plain values). Dtypes are cast.
    A checkpoint in another format ``open_reader`` reads (DeepSpeed's, DCP's...) is shown to ``build`` as
    ``ReaderContents`` instead, each rank opening its own reader.
    """
    group, storage = resolve_group(process_group), open_storage(path, storage_options)
    if not _is_native(group, storage):
        reader = agreed(group, lambda: open_reader(path, storage_options=storage_options, io_threads=io_threads,
                                                   verify=verify_checksums))
        if not isinstance(reader, NativeReader):  # (a native one: a manifest committed since; the path below)
            outcome = attempt(group.rank, lambda: _read_built(reader, build, group))
            raise_failures(group.all_gather(outcome if isinstance(outcome, Failure) else None))  # not the contents
            return outcome

    def work(storage: Storage, manifest: Manifest) -> Manifest:
        requests = agreed(group, lambda: build(manifest))
        NativeReader(storage, manifest, io_threads=io_threads, verify=verify_checksums).read(requests)
        return manifest

    return _with_retries(group, storage, work)


def _read_built(reader: CheckpointReader, build: Callable[[ReaderContents], list[ReadRequest]],
                group: Group) -> ReaderContents:
    def built() -> tuple[ReaderContents, list[ReadRequest]]:
        contents = ReaderContents(reader.tree(), reader.tensors())
        return contents, build(contents)

    contents, requests = agreed(group, built)
    reader.read(requests)
    return contents


def _shared_manifest(group: Group, storage: Storage) -> Manifest:
    """Rank 0 reads the manifest and sends it to all, so every rank loads the same generation."""
    mine = attempt(group.rank, lambda: storage.read_bytes(MANIFEST_NAME) if storage.exists(MANIFEST_NAME) else None)
    data = group.broadcast(mine if group.is_coordinator else None)
    raise_failures([data])
    if data is None:
        raise CheckpointNotFoundError(f"{storage.url(MANIFEST_NAME)}: no committed checkpoint here")
    return parse_manifest(data, storage.url(MANIFEST_NAME))


def _generation_changed(group: Group, storage: Storage, manifest: Manifest) -> bool:
    current = None
    if group.is_coordinator:
        try:
            current = read_manifest(storage).generation
        except Exception:  # noqa: BLE001 - unreadable now: report the original failure
            current = manifest.generation
    return group.broadcast(current) != manifest.generation


def _load_from(reader: CheckpointReader, state_dict: dict, strict: bool, group: Group,
               progress: ProgressCallback | None) -> None:
    """Match ``state_dict`` to the checkpoint on every rank, agree, then read (a mismatch on any rank: nothing read)."""
    def matched_on(reader: CheckpointReader):
        for view in _READER_VIEWS:
            reader = view(reader, state_dict)
        return reader, match(reader.tree(), reader.tensors(), state_dict, strict, group.rank)

    reader, matched = agreed(group, lambda: matched_on(reader))
    read_reporting(reader, matched.requests, progress)
    matched.write_back()


def load_full(path: str | os.PathLike, keys: Iterable[str] | None = None, *, verify_checksums: bool = True,
              io_threads: int = DEFAULT_IO_THREADS, storage_options: dict | None = None,
              progress: ProgressCallback | None = None) -> dict:
    """Read a checkpoint as a plain nested state dict of full CPU tensors, in this process alone.

    ``path`` (a local path or fsspec URL) holds any format ``formats.detect.open_reader`` reads: shardckpt's
    own (retried after a concurrent overwrite, the data files checked before anything is allocated), a
    safetensors file or Hugging Face directory, a torch DCP directory, or a ``torch.save`` file (read by
    ``checkpoint.load_any.load_reader``: the tree with full tensors of the stored dtypes, plain values and
    containers as the reader gives them; a ``torch.save`` file of a list or of one tensor gives that).
    ``keys`` restricts it to entries whose dotted name equals a key or starts with ``key + "."`` (e.g.
    ``["model"]``); the result keeps the saved nesting. ``verify_checksums`` checks the checksums a format
    stores (shardckpt's CRC32Cs, each tensor's whole-tensor one included; the CRC-32 of DCP's archives). ``progress(done_bytes, total_bytes)``: as
    ``load``'s, the bytes of the selected tensors.
    """
    storage = open_storage(path, storage_options)
    if not storage.exists(MANIFEST_NAME):
        reader = open_reader(path, storage_options=storage_options, io_threads=io_threads, verify=verify_checksums)
        if not isinstance(reader, NativeReader):  # (a native one: a manifest committed since; the path below)
            return load_reader(reader, keys, where=os.fspath(path), progress=progress)
    wanted = wanted_keys(keys)

    def work(storage: Storage, manifest: Manifest) -> dict:
        picked = pick(manifest.tree, (), wanted)
        refs = [TensorRef(name) for name in dict.fromkeys(tensor_refs(picked))]
        _check_files_before_allocating(storage, manifest, refs)
        reader = NativeReader(storage, manifest, io_threads=io_threads, verify=verify_checksums)
        return load_reader(reader, keys, where=storage.url(MANIFEST_NAME), progress=progress)

    return _with_retries(resolve_group(LOCAL), storage, work)


def _check_files_before_allocating(storage: Storage, manifest: Manifest, leaves_: list) -> None:
    """Stored bytes must back what the manifest claims before memory is allocated for it. From format v3
    (compressed chunks: the files' sizes alone bound little) every chunk's index row is checked too: the
    rows of a file fit in it, and each frame is no smaller than zstd could make it."""
    entries = [manifest.tensors[leaf.name] for leaf in leaves_ if isinstance(leaf, TensorRef)]
    used = {entry.name: entry.chunks.files_used() for entry in entries}  # bounded by the number of files
    files = sorted(set().union(*used.values()))
    for f in files:
        check_data_file(storage, manifest.files[f])
    for entry in entries:
        held = sum(manifest.files[f].size for f in used[entry.name])
        if min_stored_bytes(entry, manifest.version) > held:
            raise CorruptCheckpointError(f"{storage.url(MANIFEST_NAME)}: tensor {entry.name!r} claims "
                                         f"{entry.nbytes} bytes in {len(entry.chunks)} chunks, which its data "
                                         f"files' {held} bytes cannot hold")
    if manifest.version >= COMPRESSED_VERSION:
        indexes = {f: read_index(storage, manifest.files[f], manifest.version) for f in files}
        for entry in entries:
            for i, region, f in chunks_of(entry):
                problem = record_problem(indexes[f].get((entry.name, i)), entry, region)
                if problem:
                    raise CorruptCheckpointError(f"{storage.url(manifest.files[f].path)}: tensor {entry.name!r} "
                                                 f"chunk {i} {problem}")
