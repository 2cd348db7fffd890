"""Tier 0's room (tiers/budget.py): a tmpfs counted against the memory the node has, old steps evicted oldest
first but never the newest safe one nor a pinned one, and a refusal that says what was needed and what to change."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.tiers.budget import HeldStep, Space, incoming, plan_room, room, trim
from shardckpt.tiers.peers import place_replicas, ring_order

GiB = 1 << 30


def test_a_tmpfs_larger_than_memory_counts_what_memory_has():
    # /dev/shm on this machine: a 24 GiB tmpfs (all of RAM) while the ranks use part of that RAM
    assert room(Space("/dev/shm", 24 * GiB, mem_available=10 * GiB), min_free=GiB) == 9 * GiB
    assert room(Space("/nvme", 24 * GiB), min_free=GiB) == 23 * GiB
    assert room(Space("/dev/shm", GiB // 2, 10 * GiB), min_free=GiB) == 0


held_steps = st.lists(st.builds(HeldStep, key=st.tuples(st.integers(0, 2), st.integers(0, 50)),
                                nbytes=st.integers(0, 10 * GiB), pinned=st.booleans(), safe=st.booleans()),
                      max_size=6, unique_by=lambda s: s.key)


@settings(max_examples=300, deadline=None)
@given(held_steps, st.integers(0, 20 * GiB), st.integers(0, 40 * GiB), st.none() | st.integers(0, 40 * GiB))
def test_eviction_is_minimal_oldest_first_and_spares_what_must_stay(held, incoming, free, budget):
    space = Space("/dev/shm", free, mem_available=free)
    plan = plan_room(held, incoming, space, 0, budget)
    newest_safe = max((s.key for s in held if s.safe), default=None)
    evictable = sorted(s.key for s in held if not s.pinned and s.key != newest_safe)
    by_key = {s.key: s for s in held}
    used = sum(s.nbytes for s in held)

    def fits(evicted) -> bool:
        freed = sum(by_key[k].nbytes for k in evicted)
        return incoming <= free + freed and (budget is None or used - freed + incoming <= budget)

    if plan.fits:
        assert fits(plan.evict) and list(plan.evict) == evictable[:len(plan.evict)]  # a prefix: oldest first
        assert not plan.evict or not fits(plan.evict[:-1])  # and no more than needed
        assert not plan.message
    else:
        assert plan.evict == () and not fits(evictable) and "needs" in plan.message


@settings(max_examples=200, deadline=None)
@given(held_steps, st.integers(1, 4))
def test_trim_keeps_the_newest_and_what_is_pinned_or_the_last_safe(held, keep_last):
    removed = set(trim(held, keep_last))
    newest = sorted((s.key for s in held), reverse=True)[:keep_last]
    newest_safe = max((s.key for s in held if s.safe), default=None)
    assert not removed & set(newest) and newest_safe not in removed
    assert all(not s.pinned for s in held if s.key in removed)
    assert removed == {s.key for s in held if s.key not in newest and not s.pinned and s.key != newest_safe}


def test_the_refusal_names_the_need_the_room_and_the_fixes():
    held = [HeldStep((0, 10), 3 * GiB, safe=True)]
    plan = plan_room(held, 4 * GiB, Space("/dev/shm", 20 * GiB, mem_available=3 * GiB), GiB, budget=6 * GiB)
    assert not plan.fits
    for words in ("needs 4.0 GiB", "2.0 GiB free at /dev/shm", "MemAvailable, 3.0 GiB", "local_budget=6.0 GiB",
                  "3.0 GiB held by steps that must stay", "keep_last"):
        assert words in plan.message, plan.message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10 * GiB), min_size=1, max_size=3), min_size=1, max_size=6), st.data())
def test_a_step_takes_k_plus_1_copies_of_every_byte_spread_as_the_ring_places_them(nodes, data):
    k = data.draw(st.integers(0, len(nodes) - 1))
    ranks = iter(range(100))
    node_ranks = {f"n{i}": [next(ranks) for _ in sizes] for i, sizes in enumerate(nodes)}
    rank_bytes = {r: b for (node, rs), sizes in zip(node_ranks.items(), nodes) for r, b in zip(rs, sizes)}
    peers = place_replicas(ring_order(node_ranks), k)
    taken = incoming(rank_bytes, node_ranks, peers)
    assert sum(taken.values()) == (k + 1) * sum(rank_bytes.values())
    for node, ranks_ in node_ranks.items():
        held_for = [o for o, hs in peers.items() if node in hs]
        assert taken[node] == sum(rank_bytes[r] for o in [node, *held_for] for r in node_ranks[o])
