"""The restore decision (tiers/restore.py), against a simulated cluster: saves replicated to k peers, some
uploaded to tier 2, then nodes lost, replicas missing (a kill during replication), uploads uncommitted (a kill
during the tier-2 upload) and copies corrupted. An executor loop as the real one will run it (choose, route,
read each copy, exclude the ones whose checksums fail, decide again) must end on the newest save that still has
a good copy of every file, reading only good copies."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.tiers.peers import PERSISTENT, place_replicas, ring_order
from shardckpt.tiers.restore import (
    OWN, PERSISTED, REPLICA, Candidate, NodeReport, StepFiles, choose, merge, next_epoch, route, superseded,
)


@dataclass
class Cluster:
    nodes: list[str]  # the old world's nodes
    node_ranks: dict[str, list[int]]
    k: int
    layouts: dict[Candidate, StepFiles]
    holdings: dict[str, dict[Candidate, set[int]]]  # after the damage: live nodes only (new ones empty)
    persistent: set[Candidate]
    corrupt: set[tuple[str, Candidate, int]]
    lost: set[str]


@st.composite
def clusters(draw, damage: bool = True) -> Cluster:
    n = draw(st.integers(1, 5))
    nodes = [f"n{i}" for i in range(n)]
    counts = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    ranks = iter(range(sum(counts)))
    node_ranks = {node: [next(ranks) for _ in range(c)] for node, c in zip(nodes, counts)}
    k = draw(st.integers(0, n - 1))
    peers = place_replicas(ring_order(nodes), k)
    per_rank = draw(st.integers(1, 2))
    owners = tuple(node for node in nodes for _ in node_ranks[node] for _ in range(per_rank))
    layouts, holdings = {}, {node: {} for node in nodes}
    persistent = set()
    steps = sorted(draw(st.sets(st.integers(1, 60), min_size=1, max_size=4)))
    for j, step in enumerate(steps):
        epoch = draw(st.integers(0, 1)) if j else 0
        cand = Candidate(epoch, step, f"{step:04x}{j}", draw(st.integers(0, 2**32 - 1)))
        layouts[cand] = StepFiles(tuple(draw(st.integers(0, 1000)) for _ in owners), owners)
        for i, owner in enumerate(owners):
            holdings[owner].setdefault(cand, set()).add(i)
            for p in peers[owner]:  # a kill during replication leaves some replicas out
                if not damage or draw(st.booleans()) or draw(st.booleans()):
                    holdings[p].setdefault(cand, set()).add(i)
        if draw(st.booleans()):  # uploaded to tier 2 and committed (else: no upload, or killed before its manifest)
            persistent.add(cand)
    lost = set(draw(st.sets(st.sampled_from(nodes), max_size=n if damage else k)))
    live = {node: held for node, held in holdings.items() if node not in lost}
    live.update({f"new{i}": {} for i in range(draw(st.integers(0 if live else 1, 2)))})  # replacement nodes
    corrupt = set()
    if damage:
        copies = [(node, c, i) for node, held in live.items() for c, files in held.items() for i in files]
        copies += [(PERSISTENT, c, i) for c in persistent for i in range(len(layouts[c]))]
        if copies:
            corrupt = set(draw(st.sets(st.sampled_from(copies), max_size=4)))
    return Cluster(nodes, node_ranks, k, layouts, live, persistent, corrupt, lost)


def _good_copy_exists(cl: Cluster, cand: Candidate, i: int) -> bool:
    live = any(i in held.get(cand, ()) and (node, cand, i) not in cl.corrupt for node, held in cl.holdings.items())
    return live or (cand in cl.persistent and (PERSISTENT, cand, i) not in cl.corrupt)


def _oracle(cl: Cluster) -> Candidate | None:
    """The newest save (in (epoch, step) order) with a good copy of every file anywhere the restore can reach."""
    named = {c for held in cl.holdings.values() for c in held} | cl.persistent
    whole = [c for c in named if all(_good_copy_exists(cl, c, i) for i in range(len(cl.layouts[c])))]
    return max(whole, default=None)


def _needs(cl: Cluster, cand: Candidate, data) -> dict[str, set[int]]:
    """Every file is needed by some live node (the new world loads the whole state), some by several."""
    live = sorted(cl.holdings)
    needs: dict[str, set[int]] = {node: set() for node in live}
    for i in range(len(cl.layouts[cand])):
        for node in data.draw(st.sets(st.sampled_from(live), min_size=1, max_size=2)):
            needs[node].add(i)
    return needs


def _restore(cl: Cluster, data):
    """The executor's loop: decide, read every routed copy (a corrupt one fails its checksums), exclude, again."""
    excluded: set = set()
    for _ in range(1000):
        cand = choose(cl.layouts, cl.holdings, cl.persistent, excluded)
        if cand is None:
            return None, None
        routing = route(cand, cl.layouts[cand], cl.holdings, cl.persistent, _needs(cl, cand, data), excluded)
        bad = {(r.source, cand, r.file) for reads in routing.reads.values() for r in reads.values()} & cl.corrupt
        if not bad:
            return cand, routing
        assert not bad & excluded, "an excluded copy was routed again"
        excluded |= bad
    raise AssertionError("the restore loop did not end")


@settings(max_examples=250, deadline=None)
@given(clusters(), st.data())
def test_restore_ends_on_the_newest_save_with_a_good_copy_of_every_file(cl, data):
    cand, routing = _restore(cl, data)
    assert cand == _oracle(cl)
    if cand is None:
        return
    files = cl.layouts[cand]
    for node, reads in routing.reads.items():
        for i, r in reads.items():
            assert (r.source, cand, i) not in cl.corrupt
            if r.source == PERSISTENT:
                assert cand in cl.persistent and r.tier == PERSISTED
                # tier 2 only where no live node holds a good copy (a good copy is never excluded)
                assert not any(i in held.get(cand, ()) and (h, cand, i) not in cl.corrupt
                               for h, held in cl.holdings.items())
            else:
                assert i in cl.holdings[r.source][cand]
                assert r.tier == (OWN if r.source == files.owners[i] else REPLICA)
            if i in cl.holdings[node].get(cand, ()) and (node, cand, i) not in cl.corrupt:
                assert r.source == node  # a node's own good copy is always read locally
    assert all(src != dst for src, dst, _ in routing.fetches)


@settings(max_examples=150, deadline=None)
@given(clusters(damage=False), st.data())
def test_k_lost_nodes_cost_nothing_the_newest_step_comes_back_from_the_fast_tiers(cl, data):
    """No corruption, every replica written, at most k nodes lost: the newest save, and no byte from tier 2."""
    assert len(cl.lost) <= cl.k
    cand, routing = _restore(cl, data)
    assert cand == max(cl.layouts)
    assert all(r.source != PERSISTENT for reads in routing.reads.values() for r in reads.values())


@settings(max_examples=100, deadline=None)
@given(clusters(), st.data())
def test_every_rank_computes_the_same_plan(cl, data):
    cand = choose(cl.layouts, cl.holdings, cl.persistent)
    if cand is None:
        return
    needs = _needs(cl, cand, data)
    shuffled = dict(reversed(list(cl.holdings.items())))
    a = route(cand, cl.layouts[cand], cl.holdings, cl.persistent, needs)
    b = route(cand, cl.layouts[cand], shuffled, set(cl.persistent), dict(reversed(list(needs.items()))))
    assert a == b
    assert choose(cl.layouts, shuffled, set(cl.persistent)) == cand


def test_a_later_epoch_wins_over_a_higher_step_of_an_abandoned_timeline():
    old = Candidate(0, 120, "aa", 1)  # the killed run's step 120, brought back whole by a node that was away
    new = Candidate(1, 110, "bb", 2)  # saved after the restore from step 100
    files = StepFiles((10,), ("a",))
    assert choose({old: files, new: files}, {"a": {old: {0}, new: {0}}}, set()) == new
    assert next_epoch([old, new]) == 2 and next_epoch([]) == 0
    assert superseded(new, {"a": {old: {0}, new: {0}}}) == {"a": []}
    assert superseded(old, {"a": {old: {0}, new: {0}}}) == {"a": [new]}


def test_a_corrupt_only_copy_falls_back_to_tier_2_then_to_an_older_step():
    s1, s2 = Candidate(0, 10, "01", 1), Candidate(0, 20, "02", 2)
    files = StepFiles((5, 7), ("a", "b"))
    holdings = {"a": {s1: {0, 1}, s2: {0, 1}}}  # b lost; a holds b's replicas
    layouts = {s1: files, s2: files}
    excluded = {("a", s2, 1)}  # b's replica of step 20 failed its checksums
    assert choose(layouts, holdings, set(), excluded) == s1
    assert choose(layouts, holdings, {s2}, excluded) == s2
    r = route(s2, files, holdings, {s2}, {"a": {0, 1}}, excluded)
    assert r.reads["a"][0].tier == OWN and r.reads["a"][1].tier == PERSISTED and r.slowest_tier() == PERSISTED
    assert r.bytes_by() == {(OWN, True): 5, (PERSISTED, False): 7}


def test_what_a_restore_reports_is_what_was_read_not_every_route():
    step = Candidate(0, 10, "01", 1)
    files = StepFiles((5, 7), ("a", "b"))
    holdings = {"a": {step: {0, 1}}, "b": {step: {1}}}  # a holds b's replica; b lost its copy of a's file
    r = route(step, files, holdings, set(), {"a": {0, 1}, "b": {0, 1}})
    assert r.slowest_tier() == REPLICA and r.fetches == (("a", "b", 0),)
    same_world = r.restricted({"a": {0}, "b": {1}})  # each node read only its own ranks' file
    assert same_world.bytes_by() == {(OWN, True): 12} and same_world.slowest_tier() == OWN
    assert same_world.fetches == ()
    b_needs_a = r.restricted({"a": {0}, "b": {0, 1}})
    assert b_needs_a.bytes_by() == {(OWN, True): 12, (OWN, False): 5} and b_needs_a.fetches == (("a", "b", 0),)
    assert r.restricted({}).slowest_tier() is None and r.restricted({}).bytes_by() == {}


def test_of_two_saves_of_one_step_the_one_in_the_fast_tiers_wins():
    fast, slow = Candidate(0, 50, "ff", 9), Candidate(0, 50, "00", 1)  # tier 2 written apart (another generation)
    files = StepFiles((10, 10), ("a", "b"))
    layouts = {fast: files, slow: files}
    assert choose(layouts, {"a": {fast: {0, 1}}}, {slow}) == fast
    assert choose(layouts, {"a": {fast: {0}}}, {slow}) == slow  # the fast copy is not whole


def test_peers_share_the_sending():
    c = Candidate(0, 1, "01", 0)
    files = StepFiles((100, 100, 100, 100), ("x", "x", "x", "x"))  # x lost; its replicas on a and b
    holdings = {"a": {c: {0, 1, 2, 3}}, "b": {c: {0, 1, 2, 3}}, "new": {}}
    r = route(c, files, holdings, set(), {"new": {0, 1, 2, 3}})
    assert sorted(src for src, _, _ in r.fetches) == ["a", "a", "b", "b"]


def test_bad_reports_are_refused():
    c = Candidate(0, 1, "01", 0)
    with pytest.raises(ValueError, match="reports file 3"):
        choose({c: StepFiles((1,), ("a",))}, {"a": {c: {3}}}, set())
    with pytest.raises(ValueError, match="no file list"):
        choose({}, {"a": {c: {0}}}, set())
    with pytest.raises(ValueError, match="no usable copy"):
        route(c, StepFiles((1,), ("a",)), {"b": {}}, set(), {"b": {0}})


def test_reports_merge_and_files_without_their_manifest_count_for_the_one_candidate_that_names_them():
    c = Candidate(0, 30, "abcd", 7)
    files = StepFiles((4, 4), ("a", "b"), ("data-abcd/rank-00000-0.bin", "data-abcd/rank-00001-0.bin"))
    a = NodeReport("a", {c: files}, {c: {0}})
    b = NodeReport("b", {}, {}, {"abcd": {"data-abcd/rank-00001-0.bin", "data-abcd/stray.bin"}, "ffff": {"x"}})
    layouts, holdings = merge([a, b])
    assert layouts == {c: files} and holdings == {"a": {c: {0}}, "b": {c: {1}}}
    assert choose(layouts, holdings, set()) == c  # killed between node a's publishing and node b's
    other = Candidate(1, 30, "abcd", 8)  # the same generation under two manifests: attribute to neither
    _, holdings = merge([a, b, NodeReport("c", {other: files}, {})])
    assert c not in holdings["b"]
    with pytest.raises(ValueError, match="otherwise"):
        merge([a, NodeReport("c", {c: StepFiles((5, 4), ("a", "b"))}, {})])
    with pytest.raises(ValueError, match="two reports"):
        merge([a, a])
    tier2 = Candidate(0, 20, "0101", 1)
    layouts, _ = merge([a], {tier2: StepFiles((1,), ("a",))})
    assert set(layouts) == {c, tier2}
