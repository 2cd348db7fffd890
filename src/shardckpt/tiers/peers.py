"""Which peer nodes hold each node's tier-0 files (tier 1), and which rank copies whose files. Pure.

Nodes are placed on a ring, and node ``i`` of the ring copies its files to the ``k`` nodes after it: every node
sends ``k`` copies and receives ``k`` (balanced), the ``k`` holders of a node's replicas are distinct, so any
``k`` nodes may be lost and every file still has a live holder; and the ring works for any number of nodes above
``k`` (NVRx's cliques need the world to divide into groups of ``k + 1``). The ring interleaves failure
domains (racks, switches): with at least ``k + 1`` domains of equal size, no node's replica shares its domain.

Replicas are pulled, not pushed: each holder reads its peers' files from their nodes (a peer's tier 0 is a
read-only ``Storage`` to it, docs/design/tiers.md). Within a pair of nodes the ranks pair up by their index on
their node (the ``l``-th rank of each peer copies the files of the ``l``-th rank of the owner, modulo the
peer's count), so that the copying is spread over the ranks and no node leader carries the node's bytes alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from shardckpt.tiers.config import RESERVED_NODE, TierConfigError

PERSISTENT = RESERVED_NODE  # the tier-2 store, where a holder's name is expected; no node may be named so


def ring_order(nodes: Iterable[str], domain_of: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The nodes in ring order: failure domains interleaved (the largest first, then by name), each domain's nodes
    by name. The order depends only on the set of nodes and their domains, never on rank numbers, so every rank
    computes the same ring."""
    names = sorted(set(nodes))
    _check_names(names)
    domain_of = domain_of or {}
    domains: dict[str, list[str]] = {}
    for node in names:
        domains.setdefault(domain_of.get(node, f"\x00{node}"), []).append(node)  # no domain: a domain of its own
    queues = sorted(domains.values(), key=lambda members: (-len(members), members[0]))
    order: list[str] = []
    for depth in range(max((len(q) for q in queues), default=0)):
        order += [q[depth] for q in queues if depth < len(q)]
    return tuple(order)


def place_replicas(order: Sequence[str], k: int) -> dict[str, tuple[str, ...]]:
    """Node -> the ``k`` nodes that hold copies of its files: the next ``k`` on the ring."""
    n = len(order)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise TierConfigError(f"replicas {k!r}: expected an int >= 0")
    if n and k > n - 1:
        raise TierConfigError(f"replicas={k} needs at least {k + 1} nodes (each copy on another node), but the job "
                              f"has {n}: {', '.join(order[:8])}{' ...' if n > 8 else ''}; lower replicas")
    return {node: tuple(order[(i + j) % n] for j in range(1, k + 1)) for i, node in enumerate(order)}


def holders(node: str, peers: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Every node that holds ``node``'s files after replication: itself first, then its peers."""
    return (node, *peers[node])


def survives(lost: Iterable[str], peers: Mapping[str, Sequence[str]]) -> bool:
    """Whether every node's files still have a live holder once the nodes in ``lost`` are gone."""
    gone = set(lost)
    return all(any(h not in gone for h in holders(node, peers)) for node in peers)


@dataclass(frozen=True, order=True)
class Copy:
    """Rank ``dst`` copies rank ``src``'s files of a step from ``src``'s node into its own node's tier 0."""

    src: int
    dst: int


def copies(node_ranks: Mapping[str, Sequence[int]], peers: Mapping[str, Sequence[str]]) -> list[Copy]:
    """The rank-to-rank copies of one replication round, sorted: the files of the ``l``-th rank of each node go to
    the ``l % size``-th rank of each of the node's peers."""
    _check_ranks(node_ranks, peers)
    out = []
    for node, ranks in node_ranks.items():
        for local, rank in enumerate(sorted(ranks)):
            for peer in peers[node]:
                theirs = sorted(node_ranks[peer])
                out.append(Copy(rank, theirs[local % len(theirs)]))
    return sorted(out)


def node_of_ranks(node_ranks: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """Rank -> its node; a rank on two nodes is an error."""
    out: dict[int, str] = {}
    for node, ranks in node_ranks.items():
        for rank in ranks:
            if rank in out:
                raise ValueError(f"rank {rank} is on two nodes: {out[rank]!r} and {node!r}")
            out[rank] = node
    return out


def _check_names(names: Sequence[str]) -> None:
    for name in names:
        if not isinstance(name, str) or not name or name == PERSISTENT:
            raise ValueError(f"node name {name!r}: expected a non-empty string other than {PERSISTENT!r}")


def _check_ranks(node_ranks: Mapping[str, Sequence[int]], peers: Mapping[str, Sequence[str]]) -> None:
    if set(node_ranks) != set(peers):
        raise ValueError(f"the nodes with ranks ({sorted(node_ranks)}) are not the nodes placed on the ring "
                         f"({sorted(peers)})")
    if any(not ranks for ranks in node_ranks.values()):
        raise ValueError("every node needs at least one rank")
    node_of_ranks(node_ranks)
