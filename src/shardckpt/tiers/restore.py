"""The restore decision, pure: from what every live node holds, the step every rank restores, and where each node
reads each file of it from. No I/O: ``tiers.restore_io`` (to come) gathers the reports (``NodeReport``, joined by
``merge``) and executes the plan.

Vocabulary:

- a **candidate** is one committed save: ``(epoch, step, generation, digest)``. The epoch counts the job's
  restarts (a save made after the ``e``-th restore carries epoch ``e``), so that a later timeline's step 110
  wins over an abandoned one's step 120 that a node brings back. The digest (CRC32C of the manifest's bytes)
  makes two copies of one save the same candidate only when their manifests are the same bytes.
- a candidate's **files** are its manifest's ``files[]``, by index: each one's size and the node whose rank
  wrote it (its **owner**, from the manifest's metadata). Every copy of a file, in any tier, has the same path,
  bytes and checksums: tier 1 copies tier 0's files, tier 2 uploads them.
- a **holding** is what one live node's tier 0 holds: candidate -> the indexes of the files present, whole and
  matching the manifest (size, index CRC; and, with ``verify="before-choosing"``, every block).
- **persistent**: the candidates committed in tier 2 (their manifest is there).
- **excluded**: ``(holder, candidate, file)`` copies found corrupt during a fetch or a read. The executor adds
  them and decides again; a copy excluded is never read again.

A candidate is **complete** when every file has a copy that is not excluded: on a live node, or in tier 2 if
the candidate is committed there. ``choose`` takes the newest complete candidate; ``route`` points each node at
its own copy, else to a live peer's (the least loaded so far, so that the peers share the sending), else to tier 2.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Iterable, Mapping

from shardckpt.tiers.peers import PERSISTENT

OWN, REPLICA, PERSISTED = 0, 1, 2  # the tier a copy belongs to: the owner's tier 0, a peer's replica, tier 2


@dataclass(frozen=True, order=True)
class Candidate:
    """One committed save; candidates order by ``(epoch, step)`` (then generation and digest, for a total order)."""

    epoch: int
    step: int
    generation: str
    digest: int


@dataclass(frozen=True)
class StepFiles:
    """A candidate's data files, by their index in the manifest: size in bytes, owner node, and (optional) path."""

    sizes: tuple[int, ...]
    owners: tuple[str, ...]
    paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.owners) or (self.paths and len(self.paths) != len(self.sizes)):
            raise ValueError(f"{len(self.sizes)} file sizes, {len(self.owners)} owners, {len(self.paths)} paths")
        if any(s < 0 for s in self.sizes):
            raise ValueError("a file size is negative")

    def __len__(self) -> int:
        return len(self.sizes)


Holdings = Mapping[str, Mapping[Candidate, AbstractSet[int]]]  # live node -> candidate -> file indexes held
Excluded = AbstractSet[tuple[str, Candidate, int]]  # (holder: a node or PERSISTENT, candidate, file index)


@dataclass(frozen=True)
class NodeReport:
    """What one node leader found in its tier 0: ``layouts``, the candidates whose manifest is there; ``held``, their
    files present and matching the manifest (size, index size and CRC); ``orphans``, by generation, the paths of
    data files present whose manifest is not there (a kill between two nodes' publishing of one manifest)."""

    node: str
    layouts: Mapping[Candidate, StepFiles]
    held: Mapping[Candidate, AbstractSet[int]]
    orphans: Mapping[str, AbstractSet[str]] = field(default_factory=dict)


def merge(reports: Iterable[NodeReport], persistent: Mapping[Candidate, StepFiles] | None = None,
          ) -> tuple[dict[Candidate, StepFiles], dict[str, dict[Candidate, set[int]]]]:
    """Rank 0's view of the reports: every candidate's files, and what each node holds. An orphan file counts as
    held when exactly one candidate has its generation and names its path: the files of a save are closed before
    its manifest exists, and the read checks them against that manifest in any case."""
    layouts: dict[Candidate, StepFiles] = {}
    holdings: dict[str, dict[Candidate, set[int]]] = {}
    reports = list(reports)
    for source, found in [(r.node, r.layouts) for r in reports] + [(PERSISTENT, persistent or {})]:
        for candidate, files in found.items():
            if layouts.setdefault(candidate, files) != files:
                raise ValueError(f"{source!r} describes step {candidate.step} (generation {candidate.generation}) "
                                 "otherwise than another holder of the same manifest")
    by_generation: dict[str, list[Candidate]] = {}
    for candidate in layouts:
        by_generation.setdefault(candidate.generation, []).append(candidate)
    for report in reports:
        if report.node in holdings:
            raise ValueError(f"two reports from node {report.node!r}")
        held = holdings[report.node] = {c: set(files) for c, files in report.held.items()}
        for generation, paths in report.orphans.items():
            named = by_generation.get(generation, [])
            if len(named) != 1 or not layouts[named[0]].paths:
                continue  # unknown, or ambiguous: not counted
            index = {p: i for i, p in enumerate(layouts[named[0]].paths)}
            held.setdefault(named[0], set()).update(index[p] for p in paths if p in index)
    return layouts, holdings


def sources(candidate: Candidate, files: StepFiles, holdings: Holdings, persistent: AbstractSet[Candidate],
            excluded: Excluded = frozenset()) -> list[list[str]]:
    """For each file of ``candidate``, the holders of a usable copy: live nodes by name, then ``PERSISTENT``."""
    out: list[list[str]] = [[] for _ in range(len(files))]
    for node in sorted(holdings):
        for i in holdings[node].get(candidate, ()):
            if not 0 <= i < len(files):
                raise ValueError(f"node {node!r} reports file {i} of step {candidate.step}, which has {len(files)}")
            if (node, candidate, i) not in excluded:
                out[i].append(node)
    if candidate in persistent:
        for i, found in enumerate(out):
            if (PERSISTENT, candidate, i) not in excluded:
                found.append(PERSISTENT)
    return out


def choose(layouts: Mapping[Candidate, StepFiles], holdings: Holdings, persistent: AbstractSet[Candidate],
           excluded: Excluded = frozenset()) -> Candidate | None:
    """The newest complete candidate, or None (no copy of any step is whole: a fresh start). ``layouts`` must
    describe every candidate a node holds or tier 2 has committed (the executor reads one manifest of each).
    Among complete candidates of the same ``(epoch, step)`` the one with the larger share of files on live nodes."""
    named = {c for held in holdings.values() for c in held} | set(persistent)
    missing = named - set(layouts)
    if missing:
        raise ValueError(f"no file list for {sorted(missing)[:3]}: give choose() the manifest of every candidate")
    complete = {}
    for candidate in named:
        found = sources(candidate, layouts[candidate], holdings, persistent, excluded)
        if all(found):
            fast = sum(1 for holders in found if holders != [PERSISTENT])
            complete[candidate] = (candidate.epoch, candidate.step, fast / max(len(found), 1), candidate)
    # Two saves of one (epoch, step), e.g. tier 2 written apart from tier 0, hold the same state: the one with
    # more files in the fast tiers wins.
    return max(complete, key=complete.__getitem__, default=None)


@dataclass(frozen=True)
class Read:
    """Where a node reads one file of the chosen step: ``source`` is the node itself, a peer, or ``PERSISTENT``;
    ``tier`` says whose copy it is (``OWN``: the owner's tier 0, ``REPLICA``: a peer's replica, ``PERSISTED``)."""

    file: int
    source: str
    tier: int


@dataclass(frozen=True)
class Routing:
    """Each node's reads of the chosen candidate; ``fetches``: the (source node, reading node, file) reads that
    cross nodes (from the source's tier 0, served to its peers as a read-only ``Storage``)."""

    candidate: Candidate
    reads: Mapping[str, Mapping[int, Read]]
    fetches: tuple[tuple[str, str, int], ...]
    sizes: tuple[int, ...] = field(repr=False, default=())

    def bytes_by(self) -> dict[tuple[int, bool], int]:
        """Bytes read, by ``(tier, local)``: ``local`` when the reading node holds the copy itself."""
        out: dict[tuple[int, bool], int] = {}
        for node, reads in self.reads.items():
            for read in reads.values():
                key = (read.tier, read.source == node)
                out[key] = out.get(key, 0) + self.sizes[read.file]
        return out

    def restricted(self, read: Mapping[str, AbstractSet[int]]) -> Routing:
        """The routing of only the files each node did read (``read``: node -> file indexes): every node is routed
        every file, but a load reads only those its ranks' plans need."""
        reads = {node: {i: r for i, r in by_file.items() if i in read.get(node, ())}
                 for node, by_file in self.reads.items()}
        fetches = tuple(f for f in self.fetches if f[2] in read.get(f[1], ()))
        return Routing(self.candidate, reads, fetches, self.sizes)

    def slowest_tier(self) -> int | None:
        """The highest tier any node reads from (what the demo marks a resume with); None when nothing is read."""
        return max((r.tier for reads in self.reads.values() for r in reads.values()), default=None)


def route(candidate: Candidate, files: StepFiles, holdings: Holdings, persistent: AbstractSet[Candidate],
          needs: Mapping[str, Iterable[int]], excluded: Excluded = frozenset()) -> Routing:
    """Where each node reads the files its ranks need (``needs``: node -> file indexes, from the ranks' load
    plans) of ``candidate``, which must be complete. Its own copy first; else the live peer holding a copy that
    has been given the fewest bytes to send so far (the biggest files placed first; ties by name); else tier 2."""
    found = sources(candidate, files, holdings, persistent, excluded)
    wanted = sorted((-files.sizes[i], node, i) for node in needs for i in set(needs[node]))
    load: dict[str, int] = {}
    reads: dict[str, dict[int, Read]] = {node: {} for node in needs}
    fetches = []
    for _, node, i in wanted:
        if not 0 <= i < len(files):
            raise ValueError(f"node {node!r} needs file {i} of step {candidate.step}, which has {len(files)}")
        if not found[i]:
            raise ValueError(f"file {i} of step {candidate.step} has no usable copy: choose() another candidate")
        if node in found[i]:
            source = node
        else:
            peers = [h for h in found[i] if h != PERSISTENT]
            source = min(peers, key=lambda h: (load.get(h, 0), h)) if peers else PERSISTENT
            if source != PERSISTENT:
                load[source] = load.get(source, 0) + files.sizes[i]
                fetches.append((source, node, i))
        tier = PERSISTED if source == PERSISTENT else OWN if source == files.owners[i] else REPLICA
        reads[node][i] = Read(i, source, tier)
    return Routing(candidate, reads, tuple(sorted(fetches)), files.sizes)


def superseded(chosen: Candidate | None, holdings: Holdings) -> dict[str, list[Candidate]]:
    """Per node, the candidates newer than ``chosen`` (all, if None): incomplete by construction, since the newest
    complete one was chosen. The executor removes them once the restore has succeeded, so that their space is free
    and a later restore cannot mistake them for progress (the epoch guards against nodes that were away)."""
    return {node: sorted(c for c in held if chosen is None or c > chosen) for node, held in holdings.items()}


def next_epoch(candidates: Iterable[Candidate]) -> int:
    """The epoch of the saves after this restore: one more than any seen."""
    return max((c.epoch for c in candidates), default=-1) + 1
