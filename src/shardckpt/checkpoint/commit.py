"""The commit of a shardckpt checkpoint, the last step of every write of the format (``save``, ``convert``, the DCP
storage backend): from every (possibly virtual) rank's write results, the manifest written last and atomically
(rename on local disk, a single PUT on object stores), then the replaced generation's data removed. A crash
before it leaves the previous checkpoint untouched; a failed rank's result removes this generation's files."""
from __future__ import annotations

import posixpath
from typing import Any, Collection

from shardckpt._version import __version__
from shardckpt.checkpoint.agree import encoded_holds_per_rank, per_rank_names
from shardckpt.checkpoint.gc import collect
from shardckpt.checkpoint.save_plan import SavePlan
from shardckpt.dist.group import Failure, raise_failures
from shardckpt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from shardckpt.format.checksum import xor_terms
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.manifest import (MANIFEST_NAME, TABLE_VERSION, FileEntry, Manifest, TensorEntry,
                                      check_manifest, manifest_generation, version_for)
from shardckpt.io import Storage, lifecycle


def data_dir(generation: str) -> str:
    return f"data-{generation}"


def commit(storage: Storage, save_plan: SavePlan, generation: str, results: list,
           encoded_tree: Any, metadata: dict | None, overwrite: bool, here: Collection[int] | None = None) -> None:
    """Commit ``generation`` from every (possibly virtual) rank's write results (one per rank; None: it wrote
    nothing): the manifest, written last and atomically, then the replaced generation's data removed. A failed rank's result removes this
    generation's files and raises. Without ``overwrite`` the manifest is created exclusively: of writers
    racing to one new path exactly one commits, the others get ``CheckpointExistsError`` (their data removed).
    ``here``: the ranks whose files were written to ``storage`` (default all; the tiers' ranks write to their own
    node's copy), the files checked to be there before the commit."""
    failures = [r for r in results if isinstance(r, Failure)]
    if failures:
        _remove_quietly(storage, data_dir(generation))
        raise_failures(failures)
    version = version_for(save_plan.compression is not None, encoded_holds_per_rank(encoded_tree),
                          len(save_plan.tensors))
    try:
        _check_versions(results, version, encoded_tree)
    except CheckpointError:
        _remove_quietly(storage, data_dir(generation))
        raise
    first_file, files = {}, []
    for rank, result in enumerate(results):
        if result is not None:
            first_file[rank] = len(files)
            files.extend(result.files)
    crcs = xor_terms([result.crc_terms for result in results if result is not None])
    table = save_plan.table(first_file, crcs) if version >= TABLE_VERSION else None  # (made from the plan as it is)
    tensors = {} if table is not None else \
        {name: TensorEntry(name, DTYPES[tp.dtype], tp.shape, crcs.get(name, 0), tp.chunks(first_file))
         for name, tp in save_plan.tensors.items()}
    if files:
        lifecycle(storage).sync_dir(data_dir(generation))
    previous = _previous_generation(storage)
    manifest = Manifest(world_size=len(results), generation=generation, tree=None, tensors=tensors,
                        files=files, metadata=metadata or {}, created_by=f"shardckpt {__version__}",
                        version=version)
    data = manifest.to_bytes(encoded_tree, table)
    try:
        check_manifest(data, storage.url(MANIFEST_NAME))  # never commit what no load would read
    except CorruptCheckpointError as e:
        _remove_quietly(storage, data_dir(generation))
        raise CheckpointError(f"cannot save: the checkpoint would not load ({e}); nothing was committed") from None
    _check_files_there(storage, [f for r, result in enumerate(results) if result is not None and
                                 (here is None or r in here) for f in result.files], generation)
    try:
        storage.put_atomic(MANIFEST_NAME, data, exclusive=not overwrite)
    except FileExistsError:
        if _previous_generation(storage) != generation:  # the same: a run of the same conversion committed it
            storage.remove_dir(data_dir(generation))
        raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: another save committed a checkpoint here "
                                    "first; pass overwrite=True to replace it") from None
    try:  # committed: what follows only tidies up, and a failure here must not report the save as failed
        if previous is not None and previous != generation:
            storage.remove_dir(data_dir(previous))
        # what interrupted saves left here (checkpoint/gc.py); the manifest just written is not parsed again
        collect(storage, committed={data_dir(generation)})
    except (OSError, CheckpointError):
        pass


def _check_files_there(storage: Storage, files: list[FileEntry], generation: str) -> None:
    """Every file the manifest names is listed where it was written, else raise and commit nothing: a collector
    that took a long save's data for debris (object stores collect by age: ``gc --min-age`` shorter than the save)
    must fail the save, not let it commit a manifest of missing files and remove the checkpoint it replaces."""
    listed: dict[str, set[str]] = {}
    for path in (p for f in files for p in (f.path, f.index_path)):
        folder, name = posixpath.split(path)
        if folder not in listed:
            listed[folder] = set(storage.list_files(folder))
        if name not in listed[folder]:
            _remove_quietly(storage, data_dir(generation))
            raise CheckpointError(f"{storage.url(path)}: gone before the commit (removed while the save ran, e.g. "
                                  "by `shardckpt gc --min-age` shorter than the save on an object store); nothing "
                                  "was committed, the previous checkpoint is kept")


def _check_versions(results: list, version: int, encoded_tree: Any) -> None:
    """The indexes were written at the manifest's format version (a writer that was not told of per-rank
    values writes an older one, which a load of the new manifest would refuse)."""
    written = {r.version for r in results if r is not None and r.version is not None} - {version}
    if not written:
        return
    names = per_rank_names(encoded_tree)
    why = f"the tree holds per-rank values ({', '.join(map(repr, names[:3]))}), which need" if names else \
        "the manifest is"
    raise CheckpointError(f"cannot commit: {why} format v{version}, but the data files' indexes were written as "
                          f"v{min(written)}; give the writer version={version} (checkpoint.writer.write_rank_files)")


def _remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_dir(path)
    except Exception:  # noqa: BLE001 - the failure is what counts (the store may be gone); debris is gc's
        pass


def _previous_generation(storage: Storage) -> str | None:
    """The generation of the committed checkpoint about to be replaced (None if none, or unreadable)."""
    if not storage.exists(MANIFEST_NAME):
        return None
    try:
        return manifest_generation(storage.read_bytes(MANIFEST_NAME), storage.url(MANIFEST_NAME))
    except CheckpointError:
        return None
