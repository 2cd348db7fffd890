"""Tier 0 on one node: the step directories below ``<local_dir>/<run_id>/``, what they hold (a ``NodeReport``
for a restore, ``HeldStep``s for the budget), the room left, publishing a manifest and removing steps.

A step directory is ``step-NNNNNNNNN/``: the whole checkpoint's ``manifest.json`` (the same bytes on every node)
and the data and index files of this node's ranks, plus the replicas it holds of its peers' files (same paths).
A file being received is ``<path>.part-<token>``: never reported, never served, removed as debris at start."""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from shardckpt.errors import CheckpointError
from shardckpt.format.checksum import crc32c
from shardckpt.format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from shardckpt.io import LocalStorage
from shardckpt.tiers.budget import HeldStep, Space
from shardckpt.tiers.restore import Candidate, NodeReport, StepFiles

STEP_RE = re.compile(r"^step-(\d{9})$")
MAX_STEPS = 10 ** 9  # steps 0..MAX_STEPS-1: nine digits in their directories' names
RANK_RE = re.compile(r"(?:^|/)rank-(\d{5})-\d+\.bin$")
PART = ".part-"


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def run_root(local_dir: str, run_id: str) -> str:
    return os.path.join(os.path.abspath(local_dir), run_id)


def node_storage(root: str, step: int) -> LocalStorage:
    """A step directory of this node's tier 0, written without fsync (section 3 of the design: a restart keeps
    the page cache; a node crash loses the node's files anyway, which the replicas cover)."""
    return LocalStorage(os.path.join(root, step_dir(step)), durable=False)


def tiers_meta(manifest: Manifest) -> dict:
    meta = manifest.metadata.get("tiers") if isinstance(manifest.metadata, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or not isinstance(meta.get("epoch"), int):
        raise CheckpointError("not a tiers checkpoint: its manifest has no metadata['tiers'] with step and epoch")
    return meta


def file_rank(path: str) -> int:
    m = RANK_RE.search(path)
    if m is None:
        raise CheckpointError(f"{path}: not a rank's data file (rank-RRRRR-i.bin)")
    return int(m.group(1))


def describe(data: bytes, where: str) -> tuple[Candidate, StepFiles, Manifest]:
    """A tiers manifest's candidate (its digest: the CRC32C of its bytes) and files (owner: the node of the rank
    that wrote each one, from the metadata's node map)."""
    manifest = parse_manifest(data, where)
    meta = tiers_meta(manifest)
    owner_of = {int(r): node for node, ranks in meta.get("nodes", {}).items() for r in ranks}
    files = StepFiles(tuple(f.size + f.index_size for f in manifest.files),
                      tuple(owner_of.get(file_rank(f.path), "?") for f in manifest.files),
                      tuple(f.path for f in manifest.files))
    return Candidate(meta["epoch"], meta["step"], manifest.generation, crc32c(data)), files, manifest


def steps_here(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(STEP_RE.match, names) if m)


def manifest_bytes(root: str, step: int) -> bytes | None:
    try:
        with open(os.path.join(root, step_dir(step), MANIFEST_NAME), "rb") as f:
            return f.read()
    except OSError:
        return None


@dataclass(frozen=True)
class Found:
    """One step directory's committed candidate: the report's part, and the manifest's bytes (for the restore)."""

    step: int
    candidate: Candidate
    files: StepFiles
    held: frozenset[int]
    data: bytes


def scan(root: str) -> list[Found]:
    """The committed candidates of this node's tier 0 and, for each, the files present that match the manifest
    (size; index size and CRC32C): the cheap check. Every byte is checked again as a restore reads it."""
    out = []
    for step in steps_here(root):
        data = manifest_bytes(root, step)
        if data is None:
            continue
        where = os.path.join(root, step_dir(step), MANIFEST_NAME)
        try:
            candidate, files, manifest = describe(data, where)
        except CheckpointError:
            continue  # damaged or foreign: not a candidate (a restore never reads it)
        held = frozenset(i for i, f in enumerate(manifest.files) if _matches(os.path.join(root, step_dir(step)), f))
        out.append(Found(step, candidate, files, held, data))
    return out


def _matches(base: str, f) -> bool:
    try:
        if os.stat(os.path.join(base, f.path)).st_size != f.size:
            return False
        with open(os.path.join(base, f.index_path), "rb") as fh:
            index = fh.read()
        return len(index) == f.index_size and crc32c(index) == f.index_crc32c
    except OSError:
        return False


def orphans(root: str) -> dict[str, frozenset[str]]:
    """By generation, the data files (with their index) in step directories that have no manifest here: a kill
    between rank 0's commit and this node's publication of the manifest leaves them (``restore.merge`` counts
    them for the one candidate of that generation; every byte is checked as read)."""
    out: dict[str, set[str]] = {}
    for step in steps_here(root):
        base = os.path.join(root, step_dir(step))
        if os.path.exists(os.path.join(base, MANIFEST_NAME)):
            continue
        for name in _listdir(base):
            if not name.startswith("data-"):
                continue
            for f in _listdir(os.path.join(base, name)):
                index = f[:-len(".bin")] + ".index.json"
                if RANK_RE.search(f) and os.path.exists(os.path.join(base, name, index)):
                    out.setdefault(name[len("data-"):], set()).add(f"{name}/{f}")
    return {g: frozenset(p) for g, p in out.items()}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def report(node: str, found: list[Found], orphaned: dict[str, frozenset[str]] | None = None) -> NodeReport:
    return NodeReport(node, {f.candidate: f.files for f in found}, {f.candidate: f.held for f in found},
                      orphaned or {})


def publish(root: str, step: int, data: bytes) -> None:
    """Put the step's manifest in this node's step directory (atomically: the tier-0 commit on this node), then
    remove the data of other generations there (a stale directory of the same step from another epoch)."""
    storage = node_storage(root, step)
    os.makedirs(storage.root, exist_ok=True)
    generation = parse_manifest(data, storage.url(MANIFEST_NAME)).generation
    storage.put_atomic(MANIFEST_NAME, data)
    for name in storage.list_dirs():
        if name.startswith("data-") and name != f"data-{generation}":
            storage.remove_dir(name)


def remove_step(root: str, step: int) -> None:
    """The manifest first (the step stops being a candidate here), then the directory."""
    base = os.path.join(root, step_dir(step))
    try:
        os.unlink(os.path.join(base, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    shutil.rmtree(base, ignore_errors=True)


def remove_debris(root: str) -> int:
    """``.part-`` files a killed replication or upload left below ``root``; returns how many."""
    removed = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if PART in name or ".tmp-" in name:
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except OSError:
                    pass
    return removed


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def held_steps(root: str, epoch_of: dict[int, int], pinned: set[int], safe: set[int]) -> list[HeldStep]:
    """This node's steps for the budget: key ``(epoch, step)`` (epoch from the manifest where known), bytes on
    disk, and whether pinned or safe."""
    out = []
    for step in steps_here(root):
        out.append(HeldStep((epoch_of.get(step, 0), step), dir_bytes(os.path.join(root, step_dir(step))),
                            step in pinned, step in safe))
    return out


def measure(path: str) -> Space:
    """``statvfs`` at ``path``; for a tmpfs or ramfs also ``MemAvailable`` and the cgroup's headroom (its pages
    are memory charged to the container)."""
    os.makedirs(path, exist_ok=True)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if not _on_memory_fs(path):
        return Space(path, free)
    mem = [m for m in (_meminfo_available(), _cgroup_headroom()) if m is not None]
    return Space(path, free, min(mem) if mem else None)


def _on_memory_fs(path: str) -> bool:
    best, fstype = "", ""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                mount, sep = parts[4], parts.index("-")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, parts[sep + 1]
    except (OSError, ValueError, IndexError):
        return False
    return fstype in ("tmpfs", "ramfs")


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max":
                return None
            with open(usage) as f:
                return max(0, int(text) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None
