"""``shardckpt.load`` (in place, any world size) and ``load_full`` (a plain full state dict, one process)."""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from shardckpt.checkpoint.group import Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.checkpoint.load_plan import match, plan_reads
from shardckpt.checkpoint.reader import execute_reads
from shardckpt.checkpoint.save import DEFAULT_IO_THREADS
from shardckpt.errors import CheckpointNotFoundError
from shardckpt.storage.backend import Storage, open_storage
from shardckpt.storage.manifest import MANIFEST_NAME, Manifest, parse_manifest
from shardckpt.storage.tree import TensorRef, leaves, path_name, set_at

_ATTEMPTS = 3  # a concurrent overwrite can remove the data a reader is on; it then reloads the new checkpoint


def read_manifest(storage: Storage) -> Manifest:
    url = storage.url(MANIFEST_NAME)
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(f"{url}: no committed checkpoint here (no {MANIFEST_NAME})")
    return parse_manifest(storage.read_bytes(MANIFEST_NAME), url)


def load(state_dict: dict, path: str | os.PathLike, *, process_group: Any = None, strict: bool = True,
         verify_checksums: bool = True, io_threads: int = DEFAULT_IO_THREADS,
         storage_options: dict | None = None) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``, whatever world size and sharding wrote it.

    Called collectively on every rank. Each rank reads only the bytes its tensors need: plain tensors
    are filled whole, ``ShardedTensor``s and DTensors with their own region. Plain values are replaced
    by the saved ones. With ``strict``, missing or unexpected keys and shape or dtype mismatches raise
    ``IncompatibleCheckpointError`` before anything is read; otherwise the common keys load and dtypes
    are cast. ``verify_checksums`` checks the CRC32C of every chunk read whole.
    """
    group = resolve_group(process_group)
    storage = open_storage(path, storage_options)
    for attempt_no in range(_ATTEMPTS):
        manifest = _shared_manifest(group, storage)
        outcome = attempt(group.rank, lambda: _load_into(state_dict, storage, manifest, strict, verify_checksums,
                                                         io_threads))
        outcomes = group.all_gather(outcome)
        if not any(isinstance(o, Failure) for o in outcomes):
            return
        if attempt_no + 1 < _ATTEMPTS and _generation_changed(group, storage, manifest):
            continue
        raise_failures(outcomes)


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


def _load_into(state_dict: dict, storage: Storage, manifest: Manifest, strict: bool, verify: bool,
               io_threads: int) -> None:
    targets, values = match(manifest, state_dict, strict)
    execute_reads(storage, manifest, plan_reads(targets), io_threads, verify)
    with torch.no_grad():
        for target in targets:
            if target.staged:
                target.dest.copy_(target.flat.view(target.dest.shape))
    for value_path, value in values:
        set_at(state_dict, value_path, value)


def load_full(path: str | os.PathLike, keys: Iterable[str] | None = None, *, verify_checksums: bool = True,
              io_threads: int = DEFAULT_IO_THREADS, storage_options: dict | None = None) -> dict:
    """Read any shardckpt checkpoint as a plain nested state dict of full CPU tensors, in this process alone.

    ``keys`` restricts it to entries whose dotted name equals a key or starts with ``key + "."``
    (e.g. ``["model"]``); the result keeps the saved nesting.
    """
    storage = open_storage(path, storage_options)
    manifest = read_manifest(storage)
    prefixes = None if keys is None else tuple(keys)

    def wanted(name: str) -> bool:
        return prefixes is None or any(name == k or name.startswith(k + ".") for k in prefixes)

    tree = manifest.tree
    out: dict = {}
    for leaf_path, leaf in leaves(tree, lambda v: isinstance(v, TensorRef)):
        if not wanted(path_name(leaf_path)):
            continue
        if isinstance(leaf, TensorRef):
            entry = manifest.tensors[leaf.name]
            leaf = torch.empty(entry.shape, dtype=entry.dtype)
        _insert(out, tree, leaf_path, leaf)
    _load_into(out, storage, manifest, strict=False, verify=verify_checksums, io_threads=io_threads)
    return out


def _insert(out: dict, tree: Any, path: tuple, leaf: Any) -> None:
    """Place ``leaf`` at ``path`` in ``out``, creating containers shaped like those of ``tree`` on the way."""
    node, src = out, tree
    for depth, key in enumerate(path[:-1]):
        src = src[key]
        if isinstance(node, dict):
            node = node.setdefault(key, {} if isinstance(src, dict) else [])
        else:
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = {} if isinstance(src, dict) else []
            node = node[key]
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = leaf
