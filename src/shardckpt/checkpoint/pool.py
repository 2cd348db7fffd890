"""A run directory's chunk pool, as savers and collectors use it (docs/design/incremental.md, 2 and 6).

``<run dir>/shardckpt-pool/`` holds ``pool.json`` (``format.pool``) and one ``data-<generation>/`` per incremental
save: its new chunks only, immutable. The checkpoints of the pool are the run directory's direct children whose
manifest is pooled with this pool's id. Here: creating or opening the pool, listing its checkpoints, holding
generations (local ``flock``s: shared by a saver for what it references, exclusive by a collector) and the
parent table a save compares its chunks against.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from shardckpt.checkpoint.latest import child_dirs, step_of
from shardckpt.checkpoint.reachability import ManifestRefs, is_pool_file
from shardckpt.errors import BadArgumentError, CheckpointError, CorruptCheckpointError
from shardckpt.format.chunk_identity import ChunkKey, StoredChunk
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import MANIFEST_NAME, POOL_DIR, POOL_PATH, FileEntry, Manifest, chunks_of, parse_manifest
from shardckpt.format.pool import POOL_JSON, PoolInfo, new_pool_info
from shardckpt.formats.native.pool import pool_storage, read_pool_info, run_storage
from shardckpt.format.checksum import crc32c
from shardckpt.formats.native.reader import check_data_file, read_index
from shardckpt.io import LocalStorage, Storage, lifecycle, where
from shardckpt.io.navigate import child


def check_pool_argument(incremental: object, step: Storage) -> None:
    """``incremental=True``, or a path that is the checkpoint's parent (the one place a pool may be)."""
    if incremental is True or incremental is False or incremental is None:
        return
    if not isinstance(incremental, (str, os.PathLike)):
        raise BadArgumentError(f"incremental must be True or the run directory's path, got {incremental!r}")
    given, parent = os.fspath(incremental).rstrip("/"), run_storage(step).url("").rstrip("/")
    if given.startswith("file://"):
        given = given[len("file://"):]
    if "://" not in given:
        given = os.path.abspath(given)
    if given.split("://")[-1] != parent.split("://")[-1]:
        raise BadArgumentError(f"incremental={os.fspath(incremental)!r}: a pool lives in the checkpoint's parent "
                               f"directory ({parent}), not elsewhere; pass incremental=True")


def open_pool(step: Storage) -> tuple[Storage, PoolInfo]:
    """The pool beside checkpoint directory ``step``, created if missing (of two first saves racing, one creates
    ``pool.json`` and both use it)."""
    pool = pool_storage(step)
    info = read_pool_info(pool)
    if info is not None:
        return pool, info
    try:
        pool.put_atomic(POOL_JSON, new_pool_info().to_bytes(), exclusive=True)
    except FileExistsError:
        pass
    info = read_pool_info(pool)
    if info is None:
        raise CheckpointError(f"{pool.url(POOL_JSON)}: could not create the pool")
    return pool, info


@dataclass(frozen=True)
class PooledCheckpoint:
    name: str  # the run directory's child
    manifest: Manifest


def pool_checkpoints(run: Storage, pool_id: str | None, skip: str = "",
                     strict: bool = True) -> list[PooledCheckpoint]:
    """The committed checkpoints of the run directory pooled in pool ``pool_id`` (None: in any pool; what collection
    counts, as a ``pool.json`` lost or replaced leaves committed checkpoints of another id naming files in
    ``shardckpt-pool/``), by step (then name). With
    ``strict`` (collectors), a manifest that cannot be read is an error: what it names is unknown, so nothing may be
    collected; without (a save choosing its parent), it is skipped."""
    found = [_pooled(run, name, pool_id, strict) for name in _steps(run, skip)]
    return [c for c in found if c is not None]


def latest_pool_checkpoint(run: Storage, pool_id: str, skip: str = "",
                           prefer: str | None = None) -> PooledCheckpoint | None:
    """The checkpoint a save references: ``prefer`` if it is one of ``pool_checkpoints(run, pool_id, skip,
    strict=False)``, else the last of them; found by reading manifests from the last down, not all of them (a long
    run keeps hundreds of steps, and a save would read every manifest)."""
    names = _steps(run, skip)
    order = ([prefer] if prefer in names else []) + [n for n in reversed(names) if n != prefer]
    for name in order:
        found = _pooled(run, name, pool_id, strict=False)
        if found is not None:
            return found
    return None


def _steps(run: Storage, skip: str) -> list[str]:
    """The run directory's children that may be checkpoints, by step (then name; names without a step last)."""
    names = [n for n in child_dirs(run) if n != POOL_DIR and n != skip]
    return sorted(names, key=lambda n: (step_of(n) is None, step_of(n) or 0, n))


def _pooled(run: Storage, name: str, pool_id: str | None, strict: bool) -> PooledCheckpoint | None:
    path = f"{name}/{MANIFEST_NAME}"
    try:
        data = run.read_bytes(path)
    except CorruptCheckpointError:
        if strict and run.exists(path):  # (a collector: what it names is unknown; a save: skipped, as damaged)
            raise
        return None  # no manifest: not a checkpoint (or removed meanwhile)
    try:
        manifest = _parse_child(data, run.url(path), strict)
    except CheckpointError:
        if strict:
            raise
        return None
    if manifest is not None and manifest.pool is not None and pool_id in (None, manifest.pool["id"]):
        return PooledCheckpoint(name, manifest)
    return None


def _parse_child(data: bytes, where: str, strict: bool) -> Manifest | None:
    """A child's manifest; a ``manifest.json`` that is not a JSON object is another tool's, or a damaged one: a
    collector (``strict``) cannot tell which, so it is an error there (what it names is unknown)."""
    if not data.startswith(b"{") and not strict:
        return None
    return parsed_by_bytes.get(("manifest", where), data, lambda: parse_manifest(data, where))


class _ParsedByBytes:
    """Files parsed before, by location and exact bytes: a save reads its parent's manifest and indexes, and the
    sweeps of saves and ``gc`` every pooled step's manifest, and parsing is the cost (read only: callers never change
    what they get). A replaced file has other bytes and is parsed again. Bounded by the bytes kept. Kept by location, the
    bytes compared (a hash of the bytes would read them all at each look-up, as a compare does only on a hit)."""

    LIMIT = 32 << 20

    def __init__(self) -> None:
        self._by: OrderedDict[tuple, tuple[bytes, Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, where: tuple, data: bytes, parse: Callable[[], Any]) -> Any:
        with self._lock:
            kept = self._by.get(where)
            if kept is not None and kept[0] == data:
                self._by.move_to_end(where)
                return kept[1]
        parsed = parse()
        with self._lock:
            if len(data) <= self.LIMIT // 4:
                old = self._by.pop(where, None)
                self._bytes += len(data) - (len(old[0]) if old is not None else 0)
                self._by[where] = (bytes(data), parsed)
                while self._bytes > self.LIMIT:
                    _, (dropped, _) = self._by.popitem(last=False)
                    self._bytes -= len(dropped)
        return parsed


parsed_by_bytes = _ParsedByBytes()


def referenced_files(manifests: list[Manifest]) -> set[str]:
    return {p for m in manifests for f in m.files for p in (f.path, f.index_path)}


def manifest_refs(name: str, manifest: Manifest) -> ManifestRefs:
    """Pooled checkpoint ``name`` as collection sees it (``reachability``): its generation and the pool files it names."""
    return ManifestRefs(name, manifest.generation, frozenset(referenced_files([manifest])))


@dataclass(frozen=True)
class Candidate:
    """What a save compares one of its units against: the parent's row under the same key, and its file."""

    stored: StoredChunk
    crc32c: int
    file: FileEntry


def parent_table(pool: Storage, parent: Manifest) -> dict[tuple[str, int], Candidate]:
    """``(name, chunk) -> Candidate`` for every chunk of ``parent`` whose row has a digest, from its files' indexes
    (each read whole and checked against the parent's recorded size and CRC; ``read_index`` also checks that the
    data file has its recorded size). Called with the files' generations held: a file found here stays. The table of
    the checkpoint this process committed last is known (``remember_table``): its files are checked the same way,
    not parsed again."""
    known = _remembered
    if known is not None and known[1] is parent and known[0] == pool.url("") and \
            all(_intact(pool, f) for f in parent.files):
        return known[2]
    indexes = {}
    for f, entry in enumerate(parent.files):
        try:
            indexes[f] = read_index(pool, entry, parent.version, parsed_by_bytes.get)
        except CorruptCheckpointError:  # gone (a collector removed it before the hold) or damaged: not referenced
            indexes[f] = {}
    table = {}
    for entry in parent.tensors.values():
        for i, _, f in chunks_of(entry):
            rec = indexes[f].get((entry.name, i))
            if rec is None or rec.digest is None:
                continue
            stored = StoredChunk(ChunkKey(entry.name, i), parent.pool["id"], parent.files[f].path, rec.length,
                                 rec.codec, itemsize(entry.dtype), rec.digest)
            table[(entry.name, i)] = Candidate(stored, rec.crc32c, parent.files[f])
    return table


_remembered: tuple | None = None  # (pool URL, the manifest committed, its table): parent_table's next answer


def remember_table(pool: Storage, manifest: Manifest, table: dict[tuple[str, int], Candidate]) -> None:
    """The table ``parent_table(pool, manifest)`` would read, for a save just committed (the next one's parent, as a
    rule): kept while ``manifest`` is the object the pool's listing parses from its bytes (``parsed_by_bytes``)."""
    global _remembered
    _remembered = (pool.url(""), manifest, table)


def _intact(pool: Storage, file: FileEntry) -> bool:
    """What ``read_index`` checks of a file, without parsing its index: both there, with the recorded sizes, and
    the index's CRC (a damaged one makes the caller read every index: ``parent_table`` leaves that file out)."""
    try:
        check_data_file(pool, file)
        data = pool.read_bytes(file.index_path)
    except CorruptCheckpointError:
        return False
    return len(data) == file.index_size and crc32c(data) == file.index_crc32c


def hold_generations(pool: Storage, generations: set[str]) -> list:
    """Shared holds on ``data-<g>/`` for every generation ``g`` (local: a ``flock`` each, which a collector's
    exclusive lock excludes; elsewhere no-ops), taken before the referenced files are checked to exist."""
    holds = []
    try:
        for g in sorted(generations):
            holds.append(lifecycle(pool).hold_dir(f"data-{g}"))
    except BaseException:
        release_all(holds)
        raise
    return holds


def release_all(holds: list) -> None:
    for hold in holds:
        hold.release()
    holds.clear()


@dataclass(frozen=True)
class PoolUsage:
    """A run's pool as ``ls`` shows it: its data files (``data-<generation>/*``) and their bytes, and those no
    committed checkpoint names (what ``gc`` of the run may remove; None when a manifest could not be read)."""

    path: str
    generations: int
    files: int
    bytes: int
    unnamed_files: int | None
    unnamed_bytes: int | None
    problem: str | None = None  # pool.json could not be read: the rest is unknown (verify names what it breaks)


def pool_usage(run: Storage) -> PoolUsage | None:
    """The pool of run directory ``run``, if it has one (one listing of the pool, and the run's manifests)."""
    pool = child(run, POOL_DIR)
    try:
        info = read_pool_info(pool)
    except CheckpointError as e:
        return PoolUsage(where(pool), 0, 0, 0, None, None, problem=str(e))
    if info is None:
        return None
    sizes = {p: n for p, n in file_sizes(pool).items() if is_pool_file(p)}
    try:
        named = referenced_files([c.manifest for c in pool_checkpoints(run, None)])
        unnamed = [n for p, n in sizes.items() if p not in named]
        unnamed_files, unnamed_bytes = len(unnamed), sum(unnamed)
    except CheckpointError:  # a manifest that does not parse: what it names is unknown
        unnamed_files = unnamed_bytes = None
    return PoolUsage(where(pool), len({p.split("/", 1)[0] for p in sizes}), len(sizes), sum(sizes.values()),
                     unnamed_files, unnamed_bytes)


def file_sizes(storage: Storage) -> dict[str, int]:
    """Every file below ``storage`` (recursively, relative paths) with its size, in one walk or listing."""
    if isinstance(storage, LocalStorage):
        out = {}
        for top, _, files in os.walk(storage.root):
            for f in files:
                full = os.path.join(top, f)
                try:
                    out[os.path.relpath(full, storage.root).replace(os.sep, "/")] = os.stat(full).st_size
                except FileNotFoundError:
                    continue
        return out
    return {p: size for p, (size, _) in storage.listing("").items()}


__all__ = ["POOL_PATH", "open_pool", "pool_checkpoints", "parent_table", "hold_generations", "run_storage",
           "pool_usage"]


def sharing_of(step: Storage, manifest: Manifest) -> Any:
    """``verify``'s sharing report of pooled checkpoint ``manifest`` at ``step``: its tensor bytes, those its own save
    wrote, and per generation it reads from, the checkpoint that wrote them and the others that read them
    (``reachability.sharing``, over the run directory's committed checkpoints of the same pool)."""
    from shardckpt.checkpoint.reachability import sharing

    name = step.root.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    others = pool_checkpoints(run_storage(step), manifest.pool["id"], skip=name, strict=False)
    by_file: dict[str, int] = {}
    for entry in manifest.tensors.values():
        size = itemsize(entry.dtype)
        for _, region, f in chunks_of(entry):
            path = manifest.files[f].path
            by_file[path] = by_file.get(path, 0) + region.numel * size
    return sharing(manifest_refs(name, manifest), [manifest_refs(c.name, c.manifest) for c in others], by_file)


def sharing_json(report: Any) -> dict:
    return {"total_bytes": report.total_bytes, "own_bytes": report.own_bytes, "shared_bytes": report.shared_bytes,
            "shared": [{"generation": s.generation, "written_by": s.written_by, "bytes": s.bytes,
                        "also_used_by": list(s.also_used_by)} for s in report.shared]}
