"""``shardckpt.save``: plan on rank 0, every rank writes its own file, rank 0 commits the manifest last.

Commit protocol: each save writes a new generation directory ``data-<generation>/``. Only after every
rank's data and index files are durable does rank 0 write ``manifest.json`` in one atomic step
(rename on local disk, a single PUT on object stores). The manifest is the checkpoint: a crash before
it leaves the previous checkpoint untouched; an overwrite removes the previous generation's data only
after the new manifest is committed.
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Any

from shardckpt._version import __version__
from shardckpt.checkpoint.collect import is_tensor_like, local_pieces
from shardckpt.dist.group import Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.checkpoint.save_plan import PieceInfo, SavePlan, WriteTask, make_save_plan
from shardckpt.checkpoint.writer import RankResult, write_rank_files
from shardckpt.errors import CheckpointError, CheckpointExistsError, UnsupportedValueError
from shardckpt.io import Storage, open_storage
from shardckpt.format.manifest import MANIFEST_NAME, Manifest, TensorEntry, parse_manifest
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.tree import check_savable_depth, encode, leaves, path_name

DEFAULT_FILES_PER_RANK = 2  # data files each rank writes in parallel on save


def save(state_dict: dict, path: str | os.PathLike, *, process_group: Any = None, overwrite: bool = False,
         metadata: dict | None = None, files_per_rank: int = DEFAULT_FILES_PER_RANK,
         storage_options: dict | None = None) -> None:
    """Save a (nested) state dict as a checkpoint at ``path`` (a local path or an fsspec URL).

    Called collectively on every rank of ``process_group`` (default: the default group, or a world of one
    when torch.distributed is not initialised). Values may be plain tensors (full or replicated: stored
    once, by one rank), ``ShardedTensor``s, torch DTensors, or plain JSON-able values. ``metadata`` is a
    JSON-able dict stored in the manifest. A committed checkpoint at ``path`` is replaced only with
    ``overwrite=True``; readers then see the complete old or the complete new checkpoint. Each rank writes
    ``files_per_rank`` data files in parallel (rank 0's value counts).
    """
    group = resolve_group(process_group)
    storage = open_storage(path, storage_options)
    prepared = attempt(group.rank, lambda: _prepare(state_dict, metadata, group))
    gathered = group.gather(prepared if isinstance(prepared, Failure) else prepared[1])
    plan = _plan_on_coordinator(group, storage, gathered, overwrite, files_per_rank) if group.is_coordinator else None
    mine = group.scatter(_per_rank(plan, group.world_size) if group.is_coordinator else None)
    raise_failures([prepared, mine])
    pieces, _, encoded_tree = prepared
    generation, tasks, per_rank = mine
    result = attempt(group.rank, lambda: _write(storage, generation, group.rank, tasks, pieces, per_rank))
    results = group.gather(result)
    outcome = None
    if group.is_coordinator:
        outcome = attempt(0, lambda: _commit(storage, plan, results, encoded_tree, group.world_size, metadata))
    raise_failures([group.broadcast(outcome)])


def _prepare(state_dict: dict, metadata: dict | None, group: Group) -> tuple[dict, list[PieceInfo], Any]:
    check_savable_depth(state_dict)
    _check_unique_names(state_dict)
    pieces = local_pieces(state_dict)
    by_name = {p.name: p for p in pieces}
    encoded = encode(state_dict, is_tensor_like) if group.is_coordinator else None
    if metadata is not None:
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnsupportedValueError(f"save(metadata=...) must be JSON-able: {e}") from None
    return by_name, [PieceInfo.of(p) for p in pieces], encoded


def _check_unique_names(state_dict: dict) -> None:
    """Loads match entries by their keys joined with '.', so two entries may not share that name."""
    seen: set[str] = set()
    for leaf_path, _ in leaves(state_dict, is_tensor_like):
        name = path_name(leaf_path)
        if name in seen:
            raise UnsupportedValueError(f"two state-dict entries are both named {name!r} once their keys are "
                                        "joined with '.' (e.g. a key 'a.b' beside 'a' -> 'b'); rename one")
        seen.add(name)


def _plan_on_coordinator(group: Group, storage: Storage, gathered: list, overwrite: bool,
                         files_per_rank: int) -> SavePlan | Failure:
    failures = [g for g in gathered if isinstance(g, Failure)]
    if failures:
        return failures[0]

    def plan() -> SavePlan:
        if not overwrite and storage.exists(MANIFEST_NAME):
            raise CheckpointExistsError(f"{storage.url(MANIFEST_NAME)}: a checkpoint already exists; pass "
                                        "overwrite=True to replace it")
        if not isinstance(files_per_rank, int) or not 1 <= files_per_rank <= 64:
            raise ValueError(f"files_per_rank must be an int in 1..64, got {files_per_rank!r}")
        return make_save_plan(gathered, uuid.uuid4().hex[:16], files_per_rank)

    return attempt(0, plan)


def _per_rank(plan: SavePlan | Failure, world_size: int) -> list:
    if isinstance(plan, Failure):
        return [plan] * world_size
    return [(plan.generation, plan.tasks[r], plan.files_per_rank) for r in range(world_size)]


def data_dir(generation: str) -> str:
    return f"data-{generation}"


def _write(storage: Storage, generation: str, rank: int, tasks: list[WriteTask], pieces: dict,
           files_per_rank: int) -> RankResult | None:
    if not tasks:
        return None
    return write_rank_files(storage, f"{data_dir(generation)}/rank-{rank:05d}", tasks, pieces,
                            files_per_rank)


def _commit(storage: Storage, plan: SavePlan, results: list, encoded_tree: Any, world_size: int,
            metadata: dict | None) -> None:
    generation = plan.generation
    failures = [r for r in results if isinstance(r, Failure)]
    if failures:
        storage.remove_dir(data_dir(generation))
        raise_failures(failures)
    first_file, files = {}, []
    for rank, result in enumerate(results):
        if result is not None:
            first_file[rank] = len(files)
            files.extend(result.files)
    tensors = {}
    for name, tp in plan.tensors.items():
        crc = 0
        for result in results:
            crc ^= result.crc_terms.get(name, 0) if result is not None else 0
        tensors[name] = TensorEntry(name, DTYPES[tp.dtype], tp.shape, crc, tp.chunks(first_file))
    if files:
        storage.sync_dir(data_dir(generation))
    previous = _previous_generation(storage)
    manifest = Manifest(world_size=world_size, generation=generation, tree=None, tensors=tensors, files=files,
                        metadata=metadata or {}, created_by=f"shardckpt {__version__}")
    storage.put_atomic(MANIFEST_NAME, manifest.to_bytes(encoded_tree))
    if previous is not None and previous != generation:
        storage.remove_dir(data_dir(previous))


def _previous_generation(storage: Storage) -> str | None:
    """The generation of the committed checkpoint about to be replaced (None if none, or unreadable)."""
    if not storage.exists(MANIFEST_NAME):
        return None
    try:
        return parse_manifest(storage.read_bytes(MANIFEST_NAME), storage.url(MANIFEST_NAME)).generation
    except CheckpointError:
        return None
