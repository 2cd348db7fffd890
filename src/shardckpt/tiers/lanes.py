"""The background lanes of a ``CheckpointManager``: lane W writes a staged step to every node's tier 0 and
publishes its manifest on every node (the tier-0 commit); lane RP then, on its own gloo group, replicates it to
the peers (pulled through their peer servers), uploads it to tier 2 when due, and trims each node's tier 0.

Every function here is collective over the lane's group and runs in the lane's thread, the same steps in the
same order on every rank."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field

from shardckpt.checkpoint.commit import data_dir
from shardckpt.checkpoint.save import Planned, persist, plan
from shardckpt.checkpoint.stage import Staged, StagingBuffers
from shardckpt.dist.group import Failure, Group, attempt, raise_failures
from shardckpt.errors import CheckpointError, CheckpointExistsError
from shardckpt.format.checksum import crc32c
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.io import Storage
from shardckpt.tiers import local
from shardckpt.tiers.budget import TierFullError, incoming, plan_room, trim
from shardckpt.tiers.config import TierConfig
from shardckpt.tiers.copy import receive, upload
from shardckpt.tiers.peer import PeerStorage
from shardckpt.tiers.topology import Topology

log = logging.getLogger("shardckpt.tiers")


@dataclass
class NodeState:
    """What this process knows of its node's tier 0 between lanes: steps committed but not yet through lane RP
    (pinned: never evicted), steps whose replicas are all in place (safe), each step's epoch, and the byte counts
    of the last step (for the benchmark)."""

    root: str
    pinned: set[int] = field(default_factory=set)
    safe: set[int] = field(default_factory=set)
    epochs: dict[int, int] = field(default_factory=dict)
    newest: int = -1  # the newest step committed in tier 0 (latest wins: lane RP leaves older ones unreplicated)
    rejected_tier2: dict[int, int] = field(default_factory=dict)  # step -> manifest digest: the last restore's verdict
    moved: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Lanes:
    config: TierConfig
    topo: Topology
    state: NodeState
    write_group: Group
    copy_group: Group
    token: str
    addresses: dict[str, tuple[str, int]]
    buffers: StagingBuffers
    planned: Planned | None = None


def write_step(lanes: Lanes, step: int, epoch: int, staged: Staged) -> bytes | None:
    """Lane W: room agreed, every rank's files written to its node's step directory (no fsync), rank 0's commit,
    then the manifest published on every node. Returns the manifest's bytes, or None when the step was skipped
    for want of room (``on_full="skip"``)."""
    group = lanes.write_group
    synced = attempt(group.rank, lanes.buffers.synchronize)
    if isinstance(synced, Failure) and not staged.failure:
        staged = dataclasses.replace(staged, failure=synced)
    with lanes.state.lock:  # pinned from its first byte: a trim of an older step never takes it for an old one
        lanes.state.pinned.add(step)
        lanes.state.epochs[step] = epoch
    try:
        if not _room_agreed(lanes, step, staged):
            with lanes.state.lock:
                lanes.state.pinned.discard(step)
                lanes.state.epochs.pop(step, None)  # never here: no step to order a trim by, or to defer to
            return None
        storage = local.node_storage(lanes.state.root, step)
        planned = plan(staged, storage, process_group=group.pg, overwrite=True, reuse=lanes.planned)
        lanes.planned = planned
        persist(staged, planned)
    except BaseException:
        lanes.state.pinned.discard(step)
        raise
    mine = attempt(0, lambda: storage.read_bytes(MANIFEST_NAME)) if group.is_coordinator else None
    data = group.broadcast(mine)
    raise_failures([data])
    done = attempt(group.rank, lambda: local.publish(lanes.state.root, step, data) if lanes.topo.leader else None)
    raise_failures(group.all_gather(done if isinstance(done, Failure) else None))
    with lanes.state.lock:
        lanes.state.moved = {"tier0_bytes": staged.nbytes}
        lanes.state.newest = max(lanes.state.newest, step)
    return data


def _room_agreed(lanes: Lanes, step: int, staged: Staged) -> bool:
    """Every rank's staged bytes gathered; each node leader measures its room and evicts what ``budget.plan_room``
    says; every rank writes the step or every rank skips it (``on_full``), with the leader's message."""
    group, topo, config = lanes.write_group, lanes.topo, lanes.config
    sizes = group.all_gather(0 if staged.failure else staged.nbytes)
    need = incoming(dict(enumerate(sizes)), topo.node_ranks, topo.peers)[topo.node]

    def measure() -> str:
        if not topo.leader:
            return ""
        with lanes.state.lock:
            pinned, safe, epochs = set(lanes.state.pinned), set(lanes.state.safe), dict(lanes.state.epochs)
        local.remove_step(lanes.state.root, step)  # a stale directory of this step (another epoch) goes first
        held = local.held_steps(lanes.state.root, epochs, pinned, safe)
        room = plan_room(held, need, local.measure(lanes.state.root), config.min_free, config.local_budget)
        for _, old in room.evict:
            local.remove_step(lanes.state.root, old)
        return "" if room.fits else f"node {topo.node}: {room.message}"

    outcome = attempt(group.rank, measure)
    found = group.all_gather(outcome)
    raise_failures(found)
    refusals = [m for m in found if m]
    if not refusals:
        return True
    if config.on_full == "raise":
        raise TierFullError(f"step {step}: {refusals[0]}")
    if group.rank == 0:
        log.warning("shardckpt tiers: step %d skipped in tier 0: %s", step, refusals[0])
    return False


def replicate(lanes: Lanes, step: int, data: bytes) -> bool:
    """Lane RP: this rank's copies of the step (``Topology.my_copies``) pulled from the owners' peer servers into
    its node's step directory, each checked before it takes its name. Agreed: True when every copy of every rank
    is in place (the step is safe); a failure is logged and the step stays unreplicated."""
    group, topo = lanes.copy_group, lanes.topo
    manifest = parse_manifest(data, f"step {step}")

    def pull() -> int:
        moved = 0
        dst = local.node_storage(lanes.state.root, step)
        for c in topo.my_copies():
            src = PeerStorage(lanes.addresses[topo.rank_node[c.src]], lanes.token, local.step_dir(step),
                              lanes.config.peer_timeout_s)
            try:
                for f in manifest.files:
                    if local.file_rank(f.path) == c.src:
                        moved += receive(src, dst, manifest, f)
                        _test_hook("replicate", step)
            finally:
                src.close()
        return moved

    outcome = attempt(group.rank, pull)
    outcomes = group.all_gather(outcome)
    failures = [o for o in outcomes if isinstance(o, Failure)]
    if failures:
        if group.rank == 0:
            log.warning("shardckpt tiers: step %d stays unreplicated: rank %d: %s", step, failures[0].rank,
                        failures[0].error)
        return False
    with lanes.state.lock:
        lanes.state.safe.add(step)
        lanes.state.moved["replica_bytes"] = outcome
    return True


def persist_step(lanes: Lanes, step: int, data: bytes, source: Storage | None = None) -> bool:
    """Lane RP, for a step due in tier 2: every rank uploads its own files from its node's tier 0 (checked as read)
    to ``<persistent_dir>/step-NNNNNNNNN/``, then rank 0 puts the same manifest bytes there exclusively (the
    tier-2 commit; one already there with the same bytes counts) and applies ``persistent_keep_last``. Raises
    on every rank if any failed: nothing is committed then. ``source``: an upload re-driven after a restart (at
    any world size) reads every file from there (the restore's routing) instead, each rank every
    world-size-th file. False (nothing raised) when tier 2 keeps a step the last restore rejected (``_commit_tier2``)."""
    group = lanes.copy_group
    manifest = parse_manifest(data, f"step {step}")

    def send() -> int:
        src = source if source is not None else local.node_storage(lanes.state.root, step)
        dst, moved = lanes.config.persistent_storage(local.step_dir(step)), 0
        for i, f in enumerate(manifest.files):
            if (i % group.world_size if source is not None else local.file_rank(f.path)) == group.rank:
                moved += upload(src, dst, manifest, f)
                _test_hook("upload", step)
        return moved

    sent = attempt(group.rank, send)
    raise_failures(group.all_gather(sent if isinstance(sent, Failure) else None))
    done = attempt(0, lambda: _commit_tier2(lanes, step, data)) if group.is_coordinator else None
    done = group.broadcast(done)
    raise_failures([done])
    with lanes.state.lock:
        lanes.state.moved["uploaded_bytes"] = sent
    return done


def persist_staged(lanes: Lanes, step: int, staged: Staged) -> bool:
    """Lane W, for a step due in tier 2 that tier 0 had no room for (``on_full="skip"``): written to tier 2 from
    the staging buffers, as ``async_save`` would, so that the durable schedule never depends on tier 0's room.
    Committed exclusively, as an upload is; then ``persistent_keep_last`` applies. Collective over lane W. False
    (nothing written) where tier 2 keeps a step of that number the last restore rejected, as ``_commit_tier2``."""
    group = lanes.write_group
    storage = lanes.config.persistent_storage(local.step_dir(step))
    kept = attempt(0, lambda: _keeps_rejected(lanes, storage, step)) if group.is_coordinator else None
    kept = group.broadcast(kept)
    raise_failures([kept])
    if kept:
        if group.is_coordinator:
            log.warning("shardckpt tiers: step %d (no room in tier 0) not written to tier 2, which keeps the step %d "
                        "the last restore found incomplete or corrupt (remove %s to write it)", step, step,
                        storage.url(""))
        return False
    persist(staged, plan(staged, storage, process_group=group.pg, overwrite=False))
    done = attempt(0, lambda: _trim_tier2(lanes)) if group.is_coordinator else None
    raise_failures([group.broadcast(done if isinstance(done, Failure) else None)])
    with lanes.state.lock:
        lanes.state.moved = {"tier0_bytes": 0, "uploaded_bytes": staged.nbytes}
    return True


def _keeps_rejected(lanes: Lanes, storage: Storage, step: int) -> bool:
    return storage.exists(MANIFEST_NAME) and _rejected(lanes, step, storage.read_bytes(MANIFEST_NAME))


def _rejected(lanes: Lanes, step: int, manifest: bytes) -> bool:
    """Whether ``manifest`` is tier 2's step the last restore found incomplete or corrupt (by its digest)."""
    with lanes.state.lock:
        digest = lanes.state.rejected_tier2.get(step)
    return digest is not None and crc32c(manifest) == digest


def _commit_tier2(lanes: Lanes, step: int, data: bytes) -> bool:
    storage = lanes.config.persistent_storage(local.step_dir(step))
    try:
        storage.put_atomic(MANIFEST_NAME, data, exclusive=True)
    except FileExistsError:
        there = storage.read_bytes(MANIFEST_NAME)
        if there != data:
            storage.remove_dir(data_dir(parse_manifest(data, storage.url(MANIFEST_NAME)).generation))  # ours only
            if _rejected(lanes, step, there):  # the restore fell back past it: kept (never deleted on a verdict a passing read error
                # may have made), and this run's step stays in tier 0; a restore orders this run's steps first
                log.warning("shardckpt tiers: step %d not uploaded: tier 2 keeps the step %d the last restore found "
                            "incomplete or corrupt (remove %s to upload it); the next due step will be", step, step,
                            storage.url(""))
                return False
            raise CheckpointExistsError(
                f"{storage.url(MANIFEST_NAME)}: tier 2 already holds another checkpoint of step {step}, one no "
                "restore of this run fell back past (another job saving to the same persistent_dir, or this job "
                "started again without restore()); this step's upload is dropped, the checkpoint there is kept") \
                from None
    _trim_tier2(lanes)
    return True


def _trim_tier2(lanes: Lanes) -> None:
    keep = lanes.config.persistent_keep_last
    if keep is not None:
        for old in _tier2_by_age(lanes.config)[:-keep]:
            lanes.config.persistent_storage(old).remove_dir(MANIFEST_NAME)
            lanes.config.persistent_storage().remove_dir(old)


def _tier2_by_age(config: TierConfig) -> list[str]:
    """Tier 2's committed step directories, oldest first by ``(epoch, step)``: after a restore fell back, the
    steps of the abandoned timeline are older than every step saved since, whatever their numbers (one whose
    manifest does not parse is the oldest of all)."""
    root, held = config.persistent_storage(), []
    for name in root.list_dirs():
        if local.STEP_RE.match(name) and root.exists(f"{name}/{MANIFEST_NAME}"):
            try:
                candidate = local.describe(root.read_bytes(f"{name}/{MANIFEST_NAME}"), root.url(name))[0]
                held.append(((candidate.epoch, candidate.step), name))
            except CheckpointError:
                held.append(((-1, -1), name))
    return [name for _, name in sorted(held)]


def trim_node(lanes: Lanes, step: int) -> None:
    """After lane RP is through ``step``: this node keeps its newest ``keep_last`` steps (a step still pinned
    by the lanes stays; replicas go with their step)."""
    with lanes.state.lock:
        lanes.state.pinned.discard(step)
        pinned, safe, epochs = set(lanes.state.pinned), set(lanes.state.safe), dict(lanes.state.epochs)
    if not lanes.topo.leader:
        return
    held = local.held_steps(lanes.state.root, epochs, pinned, safe)
    for _, old in trim(held, lanes.config.keep_last):
        local.remove_step(lanes.state.root, old)
        with lanes.state.lock:
            lanes.state.safe.discard(old)


def _test_hook(lane: str, step: int) -> None:
    """Fault injection for the kill tests: ``SHARDCKPT_TIERS_KILL=<lane>:<step>`` kills this process with SIGKILL
    in that lane, after its first file of the first step from ``<step>`` on that the lane copies (a node lost
    mid-replication or mid-upload)."""
    want = os.environ.get("SHARDCKPT_TIERS_KILL", "")
    name, _, first = want.partition(":")
    if name == lane and first.isdigit() and step >= int(first):
        os.kill(os.getpid(), 9)
