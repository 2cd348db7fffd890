"""The restore protocol around the pure decision (``tiers.restore``): node leaders report what their tier 0
holds, rank 0 lists tier 2, every rank computes the same choice and routing from the same gathered facts, and
loads through a ``TieredStorage``. A load that fails its checksums on any rank is followed by a check of every
copy each rank read: the bad copies are excluded (never read again) and the decision is made again.

Collective over the manager's restore group, in the caller's thread, before training."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shardckpt.dist.group import Failure, Group, attempt, raise_failures
from shardckpt.errors import CheckpointError, CorruptCheckpointError
from shardckpt.format.manifest import MANIFEST_NAME, Manifest
from shardckpt.io import Storage
from shardckpt.tiers import local
from shardckpt.tiers.config import TierConfig
from shardckpt.tiers.copy import check_file
from shardckpt.tiers.peer import PeerStorage
from shardckpt.tiers.peers import PERSISTENT
from shardckpt.tiers.restore import Candidate, StepFiles, choose, merge, next_epoch, route, superseded
from shardckpt.tiers.tiered import TieredStorage

log = logging.getLogger("shardckpt.tiers")
TIER_NAMES = {0: "tier0", 1: "tier1", 2: "tier2"}


class RestoreError(CheckpointError):
    """Candidates existed but none could be restored (every one failed its checksums somewhere)."""


@dataclass(frozen=True)
class Restored:
    """What ``restore`` restored: the step and its epoch, the sizes of the files the job read, by tier (a file
    once per node that read from it; ``"tier0"``: a node's own files, ``"tier1"``: replicas, on this node or a
    peer's, ``"tier2"``), the slowest tier read from (the same on every rank), the copies excluded as corrupt, the
    seconds it took and the saved manifest's metadata."""

    step: int
    epoch: int
    candidate: Candidate
    tiers: dict[str, int]
    slowest_tier: str
    seconds: float
    excluded: tuple = ()
    metadata: dict = field(default_factory=dict)
    storage: Storage | None = field(default=None, repr=False, compare=False)
    """Where each of the step's files was read from (this rank's routing): a re-driven upload reads them again."""


@dataclass
class Facts:
    """Everything every rank needs to decide alike: the merged layouts and holdings, tier 2's candidates, the
    manifests' bytes by candidate, and each live node's peer-server address."""

    layouts: dict
    holdings: dict
    persistent: set
    manifests: dict
    addresses: dict


def gather_facts(group: Group, leader: bool, node: str, root: str, config: TierConfig,
                 address: tuple | None) -> Facts:
    """Node leaders scan their tier 0; rank 0 lists tier 2; all gathered on every rank."""
    found = attempt(group.rank, lambda: (local.scan(root), local.orphans(root)) if leader else None)
    reports = group.all_gather((node, found, address))
    raise_failures([f for _, f, _ in reports])
    tier2 = attempt(0, lambda: scan_persistent(config)) if group.is_coordinator else None
    tier2 = group.broadcast(tier2)
    raise_failures([tier2])
    manifests = {c: data for c, (_, data) in tier2.items()}
    node_reports = []
    for name, found, _ in reports:
        if found is not None:
            node_reports.append(local.report(name, *found))
            manifests.update({f.candidate: f.data for f in found[0]})
    layouts, holdings = merge(node_reports, {c: files for c, (files, _) in tier2.items()})
    addresses = {name: addr for name, _, addr in reports if addr is not None}
    return Facts(layouts, holdings, set(tier2), manifests, addresses)


def scan_persistent(config: TierConfig) -> dict[Candidate, tuple[StepFiles, bytes]]:
    """Tier 2's committed tiers steps (a step directory with a manifest that parses)."""
    if config.persistent_dir is None:
        return {}
    root = config.persistent_storage()
    out = {}
    for name in root.list_dirs():
        if not local.STEP_RE.match(name) or not root.exists(f"{name}/{MANIFEST_NAME}"):
            continue
        data = root.read_bytes(f"{name}/{MANIFEST_NAME}")
        try:
            candidate, files, _ = local.describe(data, root.url(f"{name}/{MANIFEST_NAME}"))
        except CheckpointError:
            continue
        out[candidate] = (files, data)
    return out


@dataclass
class Source:
    """How this rank reaches each holder: its own node's directory, the peers' servers, tier 2."""

    node: str
    root: str
    token: str
    config: TierConfig  # tier 2's place and options
    timeout_s: float

    def storage(self, holder: str, facts: Facts, step: int) -> Storage:
        if holder == self.node:
            return local.node_storage(self.root, step)
        if holder == PERSISTENT:
            return self.config.persistent_storage(local.step_dir(step))
        return PeerStorage(facts.addresses[holder], self.token, local.step_dir(step), self.timeout_s)


def restore(group: Group, source: Source, facts: Facts, load: Callable[[Storage], Any]) -> Restored | None:
    """Choose, route, load; on a checksum failure exclude the bad copies and choose again (see the module
    docstring). None when no step is complete anywhere (a fresh start)."""
    started, excluded = time.perf_counter(), set()
    while True:
        chosen = choose(facts.layouts, facts.holdings, facts.persistent, frozenset(excluded))
        if chosen is None:
            if excluded:
                raise RestoreError(f"no step can be restored: every candidate has a file whose copies all failed "
                                   f"their checksums (excluded: {sorted(excluded)[:4]})")
            return None
        files = facts.layouts[chosen]
        routing = route(chosen, files, facts.holdings, facts.persistent,
                        {n: range(len(files)) for n in facts.addresses}, frozenset(excluded))
        data = facts.manifests[chosen]
        _, _, manifest = local.describe(data, f"step {chosen.step}")
        places = _places(source, facts, chosen.step, manifest, routing.reads[source.node])
        tiered = TieredStorage(data, places)
        outcome = attempt(group.rank, lambda: load(tiered))
        failed = isinstance(outcome, Failure)
        corrupt = failed and isinstance(outcome.error, CorruptCheckpointError)
        bad = attempt(group.rank, lambda: _bad_copies(source, chosen, manifest, routing.reads[source.node], tiered,
                                                      places)) if corrupt else set()
        if isinstance(bad, Failure):  # the re-check could not read (a store's retries spent): every rank raises it
            outcome, corrupt, bad = bad, False, set()
        read = (source.node, _files_read(manifest, tiered))
        every = group.all_gather((failed, bad, outcome if failed and not corrupt else None, read))
        raise_failures([o for _, _, o, _ in every if o is not None])
        if not any(f for f, _, _, _ in every):
            by_node: dict[str, set[int]] = {}
            for _, _, _, (node, files_read) in every:
                by_node.setdefault(node, set()).update(files_read)
            return _restored(chosen, manifest, routing.restricted(by_node), time.perf_counter() - started, excluded,
                             tiered)
        new = set().union(*(b for _, b, _, _ in every))
        if not new:
            raise RestoreError(f"step {chosen.step}: the load failed its checksums, but every copy read checks out "
                               f"on a second read ({outcome.error if failed else 'on another rank'})")
        log.warning("shardckpt tiers: restore of step %d: excluding %d corrupt copies %s, choosing again",
                    chosen.step, len(new), sorted((h, i) for h, _, i in new)[:4])
        excluded |= new


def _places(source: Source, facts: Facts, step: int, manifest: Manifest, reads) -> dict[str, Storage]:
    by_holder: dict[str, Storage] = {}
    places = {}
    for i, f in enumerate(manifest.files):
        holder = reads[i].source
        if holder not in by_holder:
            by_holder[holder] = source.storage(holder, facts, step)
        places[f.path] = places[f.index_path] = by_holder[holder]
    return places


def _files_read(manifest: Manifest, tiered: TieredStorage) -> set[int]:
    return {i for i, f in enumerate(manifest.files) if f.path in tiered.touched or f.index_path in tiered.touched}


def _bad_copies(source: Source, chosen: Candidate, manifest: Manifest, reads, tiered: TieredStorage,
                places: dict) -> set:
    """The copies this rank read that fail a full check: ``(holder, candidate, file index)``."""
    bad = set()
    for i, f in enumerate(manifest.files):
        if f.path not in tiered.touched and f.index_path not in tiered.touched:
            continue
        try:
            check_file(places[f.path], manifest, f)
        except CorruptCheckpointError:
            bad.add((reads[i].source, chosen, i))
    return bad


def _restored(chosen: Candidate, manifest: Manifest, routing, seconds: float, excluded: set,
              tiered: TieredStorage) -> Restored:
    tiers: dict[str, int] = {}
    for (tier, _), n in routing.bytes_by().items():
        tiers[TIER_NAMES[tier]] = tiers.get(TIER_NAMES[tier], 0) + n
    slowest = routing.slowest_tier()
    return Restored(chosen.step, chosen.epoch, chosen, tiers, TIER_NAMES.get(slowest, "tier0"), seconds,
                    tuple(sorted(excluded)), dict(manifest.metadata), tiered)


def after_restore(leader: bool, node: str, root: str, facts: Facts, chosen: Candidate | None) -> int:
    """Node leaders remove the candidates newer than the one restored; the epoch of the saves that follow."""
    if leader:
        steps = {c.step: c for c in superseded(chosen, facts.holdings).get(node, [])}
        for step in steps:
            local.remove_step(root, step)
    return next_epoch(facts.layouts)
