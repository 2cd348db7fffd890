"""Who is where: the node map every rank agrees on at ``CheckpointManager`` start (one all-gather), the node
leaders, the peer servers' addresses and the replica placement."""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from shardckpt.dist.group import Group
from shardckpt.tiers.config import TierConfig
from shardckpt.tiers.peers import copies, node_of_ranks, place_replicas, ring_order

log = logging.getLogger("shardckpt.tiers")


@dataclass(frozen=True)
class Topology:
    node: str
    rank: int
    node_ranks: dict[str, tuple[int, ...]]
    domains: dict[str, str]
    peers: dict[str, tuple[str, ...]]  # node -> the nodes holding its replicas

    @property
    def leader(self) -> bool:
        """Whether this rank is its node's lowest: it scans, publishes, evicts and serves for the node."""
        return self.rank == min(self.node_ranks[self.node])

    @property
    def rank_node(self) -> dict[int, str]:
        return node_of_ranks(self.node_ranks)

    def my_copies(self) -> list:
        """The copies of one replication round this rank makes (``peers.Copy``: ``src`` rank's files to here)."""
        return [c for c in copies(self.node_ranks, self.peers) if c.dst == self.rank]


def node_name(config: TierConfig) -> str:
    return config.node_id or os.environ.get("SHARDCKPT_NODE_ID") or socket.gethostname()


def join(group: Group, config: TierConfig) -> Topology:
    """Collective over ``group``: every rank's node and domain gathered, the ring and the replica placement. A job
    on fewer than ``replicas + 1`` nodes goes on with ``nodes - 1`` replicas, with a warning."""
    node = node_name(config)
    seen = group.all_gather((node, config.failure_domain or node))
    node_ranks: dict[str, list[int]] = {}
    for rank, (n, _) in enumerate(seen):
        node_ranks.setdefault(n, []).append(rank)
    domains = {n: d for n, d in seen}
    order = ring_order(sorted(node_ranks), domains)
    k = min(config.replicas, len(order) - 1)
    if k < config.replicas and group.rank == 0:
        log.warning("shardckpt tiers: replicas=%d needs %d nodes, the job has %d: going on with %d replica(s)%s",
                    config.replicas, config.replicas + 1, len(order), k,
                    " (none: a lost node loses its tier-0 files)" if k == 0 else "")
    return Topology(node, group.rank, {n: tuple(r) for n, r in node_ranks.items()}, domains, place_replicas(order, k))
