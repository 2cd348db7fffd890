"""Replica placement (tiers/peers.py): every node's files on k distinct other nodes, balanced, any k losses
survived, failure domains apart where they can be, and every rank's files copied by one rank of each peer."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.tiers.config import TierConfigError
from shardckpt.tiers.peers import PERSISTENT, node_of_ranks, place_replicas, ring_order, copies, survives


@st.composite
def rings(draw, min_nodes: int = 1, max_nodes: int = 9):
    n = draw(st.integers(min_nodes, max_nodes))
    nodes = [f"node{i:02d}" for i in range(n)]
    k = draw(st.integers(0, n - 1))
    domains = draw(st.none() | st.lists(st.sampled_from("abcd"), min_size=n, max_size=n))
    domain_of = dict(zip(nodes, domains)) if domains else None
    return nodes, k, domain_of


@settings(max_examples=300, deadline=None)
@given(rings())
def test_each_node_has_k_distinct_other_holders_and_receives_k(case):
    nodes, k, domain_of = case
    peers = place_replicas(ring_order(nodes, domain_of), k)
    assert set(peers) == set(nodes)
    for node, mine in peers.items():
        assert len(mine) == len(set(mine)) == k and node not in mine
    received = {node: 0 for node in nodes}
    for mine in peers.values():
        for p in mine:
            received[p] += 1
    assert set(received.values()) <= {k}  # balanced: every node holds k nodes' replicas


@settings(max_examples=200, deadline=None)
@given(rings(max_nodes=7))
def test_any_k_lost_nodes_leave_every_file_a_holder_and_k_plus_1_can_not(case):
    nodes, k, domain_of = case
    peers = place_replicas(ring_order(nodes, domain_of), k)
    for lost in itertools.combinations(nodes, k):
        assert survives(lost, peers)
    if k + 1 <= len(nodes):  # the bound is tight: a node and its k peers
        node = nodes[0]
        assert not survives({node, *peers[node]}, peers)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_equal_domains_enough_of_them_keep_replicas_out_of_the_owners_domain(domains, per_domain, data):
    k = data.draw(st.integers(0, domains - 1))
    nodes = [f"n{d}-{i}" for d in range(domains) for i in range(per_domain)]
    domain_of = {n: n.split("-")[0] for n in nodes}
    shuffled = data.draw(st.permutations(nodes))
    peers = place_replicas(ring_order(shuffled, domain_of), k)
    for node, mine in peers.items():
        assert all(domain_of[p] != domain_of[node] for p in mine), (node, mine)


@given(st.permutations([f"h{i}" for i in range(6)]))
def test_the_ring_depends_on_the_nodes_not_their_order(nodes):
    assert ring_order(nodes) == ring_order(sorted(nodes)) == tuple(sorted(nodes))


@settings(max_examples=200, deadline=None)
@given(rings(), st.data())
def test_every_ranks_files_go_to_one_rank_on_each_peer(case, data):
    nodes, k, _ = case
    counts = data.draw(st.lists(st.integers(1, 3), min_size=len(nodes), max_size=len(nodes)))
    ranks = iter(range(sum(counts)))
    node_ranks = {node: [next(ranks) for _ in range(c)] for node, c in zip(nodes, counts)}
    peers = place_replicas(ring_order(nodes), k)
    node_of = node_of_ranks(node_ranks)
    plan = copies(node_ranks, peers)
    assert plan == sorted(plan)
    by_src: dict[int, list[str]] = {}
    for s in plan:
        by_src.setdefault(s.src, []).append(node_of[s.dst])
    for rank, node in node_of.items():
        assert sorted(by_src.get(rank, [])) == sorted(peers[node])  # one rank of each peer node, no other


def test_more_replicas_than_other_nodes_is_refused_with_the_count():
    with pytest.raises(TierConfigError, match="replicas=2 needs at least 3 nodes.*has 2"):
        place_replicas(("a", "b"), 2)
    assert place_replicas(("a",), 0) == {"a": ()}


def test_the_persistent_marker_is_no_node_name():
    with pytest.raises(ValueError, match="node name"):
        ring_order(["a", PERSISTENT])
    with pytest.raises(ValueError, match="two nodes"):
        node_of_ranks({"a": [0, 1], "b": [1]})
