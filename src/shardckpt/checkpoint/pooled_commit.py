"""An incremental save's commit (rank 0; ``checkpoint.incremental`` step 3): the v5 manifest naming this save's new
files and every referenced one, checked as a load would read it and written last, atomically; then the table of what
it stores, kept for the next save's parent (``pool.remember_table``)."""
from __future__ import annotations

from typing import Any

from shardckpt._version import __version__
from shardckpt.checkpoint.commit import _remove_quietly, data_dir
from shardckpt.checkpoint.gc import collect
from shardckpt.checkpoint.pool import POOL_PATH, Candidate, parsed_by_bytes, remember_table
from shardckpt.checkpoint.save_plan import itemsize_of
from shardckpt.dist.group import Failure, raise_failures
from shardckpt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardckpt.format.chunk_identity import ChunkKey, StoredChunk
from shardckpt.format.chunks import compact_chunks
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.manifest import MANIFEST_NAME, POOLED_VERSION, Manifest, TensorEntry, parse_manifest
from shardckpt.io import Storage, lifecycle


def commit_pooled(planned: Any, whole: Any, shares: list, staged: Any) -> bool:
    """The v5 manifest: this save's files, then every referenced file once; each unit placed in its file. Returns
    whether it replaced a committed checkpoint."""
    pool, storage = whole.pool, planned.storage
    failures = [s for s in shares if isinstance(s, Failure)]
    if failures:
        _remove_quietly(pool, data_dir(planned.generation))
        raise_failures(failures)
    files, first = [], {}
    for rank, share in enumerate(shares):
        if share is not None:
            first[rank] = len(files)
            files.extend(share.files)
    at = {}
    for share in shares:
        for path in (share.refs.values() if share is not None else ()):
            if path not in at:
                at[path] = len(files)
                files.append(whole.ref_files[path])
    tensors = {name: _tensor_entry(name, tp, shares, first, at) for name, tp in whole.save_plan.tensors.items()}
    if any(s is not None and s.files for s in shares):
        lifecycle(pool).sync_dir(data_dir(planned.generation))
    if whole.lease is not None:
        whole.lease.check_fresh()
    manifest = Manifest(world_size=planned.group.world_size, generation=planned.generation, tree=None,
                        tensors=tensors, files=files, metadata=staged.metadata or {},
                        created_by=f"shardckpt {__version__}", version=POOLED_VERSION,
                        pool={"path": POOL_PATH, "id": whole.info.id})
    table = _table_of(whole, shares)  # (before the commit: nothing after it may fail the save)
    replaced, committed = _put_manifest(storage, pool, manifest.to_bytes(planned.tree), planned)
    remember_table(pool, committed, table)
    return replaced


def _table_of(whole: Any, shares: list) -> dict:
    """``parent_table(pool, manifest)`` as this save knows it, without reading the pool back: a unit referenced keeps
    its candidate (the same row of the same file), a unit written is its writer's row in its new file."""
    table = {}
    for share in shares:
        if share is None:
            continue
        for key in share.refs:
            table[key] = whole.candidates[key]
        for key, k in share.placed.items():
            length, codec, crc, digest = share.rows[key]
            if digest is not None:
                stored = StoredChunk(ChunkKey(*key), whole.info.id, share.files[k].path, length, codec,
                                     itemsize_of(whole.save_plan.tensors[key[0]].dtype), digest)
                table[key] = Candidate(stored, crc, share.files[k])
    return table


def _tensor_entry(name: str, tp: Any, shares: list, first: dict, at: dict) -> TensorEntry:
    file_of = []
    for chunk, rank in enumerate(tp.writers):
        share = shares[rank]
        path = share.refs.get((name, chunk))
        file_of.append(at[path] if path is not None else first[rank] + share.placed[(name, chunk)])
    crc = 0
    for share in shares:
        crc ^= share.crc_terms.get(name, 0) if share is not None else 0
    return TensorEntry(name, DTYPES[tp.dtype], tp.shape, crc, compact_chunks(tp.regions, file_of, tp.shape))


def _put_manifest(storage: Storage, pool: Storage, data: bytes, planned: Any) -> tuple[bool, Manifest]:
    """Commit: checked as a load would read it, then written atomically (exclusively unless ``overwrite``); then a
    replaced non-pooled checkpoint's own data, and the step directory's debris, removed. Returns whether a
    committed checkpoint was replaced, and the manifest parsed."""
    try:  # kept parsed: the next save's listing of the run parses it again (``pool.parsed_by_bytes``)
        where = storage.url(MANIFEST_NAME)
        committed = parsed_by_bytes.get(("manifest", where), data, lambda: parse_manifest(data, where))
    except CorruptCheckpointError as e:
        _remove_quietly(pool, data_dir(planned.generation))
        raise CheckpointError(f"cannot save: the checkpoint would not load ({e}); nothing was committed") from None
    replaced = storage.exists(MANIFEST_NAME)
    previous = _own_generation(storage) if replaced else None
    try:
        storage.put_atomic(MANIFEST_NAME, data, exclusive=not planned.overwrite)
    except FileExistsError:
        _remove_quietly(pool, data_dir(planned.generation))
        raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: another save committed a checkpoint here "
                                    "first; pass overwrite=True to replace it") from None
    try:  # committed: only tidying up from here
        if previous is not None:
            storage.remove_dir(data_dir(previous))
        collect(storage, committed=set())
    except (OSError, CheckpointError):
        pass
    return replaced, committed


def _own_generation(storage: Storage) -> str | None:
    """The generation of a committed non-pooled checkpoint about to be replaced (its data is in its directory)."""
    try:
        manifest = parse_manifest(storage.read_bytes(MANIFEST_NAME), storage.url(MANIFEST_NAME))
    except CheckpointError:
        return None
    return None if manifest.pool is not None else manifest.generation


__all__ = ["commit_pooled"]
