"""Collection by reachability (checkpoint/reachability.py) and retention (checkpoint/retention.py).

The pure decisions are property-tested; the two protocols they serve (object stores: leases and sweep markers;
local disk: shared and exclusive flocks) are checked over every interleaving of a save, a collector and an ``rm``,
each killed after any step (``_pool_model``): no committed checkpoint ever names a deleted file. Each ordering the
design notes call necessary is shown to be, by a mutant that breaks a checkpoint."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.checkpoint.reachability import (
    Lease, ManifestRefs, PoolEntry, SweepMarker, consolidate, generation_of, redundant_leases, referenced, sharing,
    stale_leases, sweep_candidates, sweep_deletions, usable_references,
)
from shardckpt.checkpoint.retention import Retention, steps_to_keep, steps_to_remove
from shardckpt.errors import BadArgumentError, CorruptCheckpointError
from tests.checkpoint import _pool_model as model

GENS = ["a", "b", "c", "d"]
files_st = st.sets(st.builds(lambda g, n: f"data-{g}/rank-0000{n}-0.bin", st.sampled_from(GENS), st.integers(0, 3)),
                   max_size=12)


@settings(max_examples=300, deadline=None)
@given(files_st, st.lists(files_st, max_size=3), st.lists(st.tuples(st.sampled_from(GENS), files_st), max_size=2),
       st.lists(st.floats(0, 10), min_size=12, max_size=12), st.floats(0, 10))
def test_candidates_are_exactly_the_unprotected_old_files(pool, manifest_files, lease_specs, ages, fresh):
    manifests = [ManifestRefs(f"step-{i}", "e", frozenset(f)) for i, f in enumerate(manifest_files)]
    leases = [Lease(g, f"step-{9 - i}", frozenset(f), 0.0) for i, (g, f) in enumerate(lease_specs)]
    entries = [PoolEntry(p, age) for p, age in zip(sorted(pool), ages)]
    cands = sweep_candidates(entries, manifests, leases, fresh)
    for entry in entries:
        protected = entry.path in referenced(manifests) or any(entry.path in lease.files for lease in leases) or \
            any(generation_of(entry.path) == lease.generation for lease in leases) or entry.age_s < fresh
        assert (entry.path in cands) == (not protected)
    later = sweep_deletions(cands, leases[:1], manifests[:1])
    assert later <= cands and not later & referenced(manifests[:1])
    assert not any(generation_of(p) == lease.generation or p in lease.files for p in later for lease in leases[:1])


def test_a_save_drops_references_a_marker_names_or_that_are_gone():
    wanted = {"data-a/x.bin", "data-a/y.bin", "data-b/z.bin"}
    marker = SweepMarker("m", frozenset({"data-a/y.bin"}), 1.0)
    assert usable_references(wanted, [marker], wanted - {"data-b/z.bin"}) == {"data-a/x.bin"}


def test_leases_redundant_once_committed_stale_only_when_old_and_uncommitted():
    done, live, dead = (Lease("a", "step-1", frozenset(), 1.0), Lease("b", "step-2", frozenset(), 1.0),
                        Lease("c", "step-3", frozenset(), 9e9))
    committed = {"step-1": "a", "step-3": "x"}  # step-3 holds another save's manifest: c's save never committed
    assert redundant_leases([done, live, dead], committed) == [done]
    assert stale_leases([done, live, dead], committed, 6 * 3600.0) == [dead]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(GENS), st.integers(0, 10**9)), st.integers(0, 5))
def test_consolidation_keeps_the_generations_it_takes_the_most_from(by_gen, cap):
    rewrite = consolidate(by_gen, cap)
    kept = set(by_gen) - rewrite
    assert len(kept) == min(cap, len(by_gen))
    assert all(by_gen[k] >= by_gen[r] for k in kept for r in rewrite)


def test_sharing_names_who_wrote_what_and_who_else_reads_it():
    m1 = ManifestRefs("step-1", "a", frozenset({"data-a/0.bin", "data-a/1.bin"}))
    m2 = ManifestRefs("step-2", "b", frozenset({"data-a/0.bin", "data-b/0.bin"}))
    m3 = ManifestRefs("step-3", "c", frozenset({"data-a/0.bin", "data-c/0.bin"}))
    report = sharing(m3, [m1, m2, m3], {"data-a/0.bin": 900, "data-c/0.bin": 100})
    assert (report.total_bytes, report.own_bytes, report.shared_bytes) == (1000, 100, 900)
    (origin,) = report.shared
    assert (origin.generation, origin.written_by, origin.bytes, origin.also_used_by) == ("a", "step-1", 900, ("step-2",))
    orphan = sharing(m3, [m2, m3], {"data-a/0.bin": 900})  # step-1 removed: its data lives on for the others
    assert orphan.shared[0].written_by is None and orphan.shared[0].also_used_by == ("step-2",)
    with pytest.raises(CorruptCheckpointError):
        generation_of("../etc/passwd")


# ---- the protocols, every interleaving ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["s3", "local"])
def test_no_interleaving_of_save_gc_rm_and_kills_breaks_a_committed_checkpoint(kind):
    saver, gc = (model.saver_s3(), model.collector_s3()) if kind == "s3" else \
        (model.saver_local(), model.collector_local())
    outcome = model.explore([saver, gc, model.RM])
    assert outcome.violation is None, outcome.violation
    assert outcome.committed_with_reference and outcome.collected_debris  # dedup and collection both happen
    assert outcome.states > 500


def _without(steps, *drop):
    return tuple(s for s in steps if s not in drop)


def _swap(steps, a, b):
    out = list(steps)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


S3_SAVER = (model._lease, model._list_markers, model._check, model._write, model._commit, model._unlease)
MUTANTS = {
    "gc lists manifests before leases after its marker": (
        model.saver_s3(), model.collector_s3(_swap(model.GC_S3, model._list_leases_2, model._list_manifests_2))),
    "gc publishes no marker": (model.saver_s3(), model.collector_s3(_without(model.GC_S3, model._marker))),
    "gc does not list leases again": (model.saver_s3(), model.collector_s3(_without(model.GC_S3, model._list_leases_2))),
    "gc does not list manifests again": (
        model.saver_s3(), model.collector_s3(_without(model.GC_S3, model._list_manifests_2))),
    "save ignores markers": (model.saver_s3(_without(S3_SAVER, model._list_markers)), model.collector_s3()),
    "save checks before its lease": (model.saver_s3(_swap(S3_SAVER, model._lease, model._check)), model.collector_s3()),
    "local gc reads manifests before locking": (model.saver_local(), model.collector_local(
        _swap(model.GC_LOCAL, model._lock_free_generations, model._list_manifests_local))),
    "local save checks before holding": (model.saver_local((model._check_local, model._hold_shared(("a", "5")),
                                                            model._write, model._commit, model._release_step("saver"))),
                                         model.collector_local()),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_ordering_is_needed(mutant):
    saver, gc = MUTANTS[mutant]
    assert model.explore([saver, gc, model.RM], kills=False).violation is not None


# ---- retention -----------------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 400), max_size=30), st.one_of(st.none(), st.integers(1, 8)),
       st.one_of(st.none(), st.integers(1, 50)), st.sets(st.integers(0, 400), max_size=2))
def test_retention_keeps_the_last_n_every_mth_and_the_protected(steps, last, every, protect):
    policy = Retention(last, every)
    keep, remove = steps_to_keep(steps, policy, protect), steps_to_remove(steps, policy, protect)
    assert keep | set(remove) == steps and not keep & set(remove) and remove == sorted(remove)
    if last is None:
        assert keep == steps
        return
    assert set(sorted(steps)[-last:]) <= keep  # the newest N, so never the latest
    assert all(s in keep for s in steps if every and s % every == 0)
    assert protect & steps <= keep
    assert all(s in sorted(steps)[-last:] or (every and s % every == 0) or s in protect for s in keep)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_retention_refuses_what_is_not_a_positive_int(bad):
    with pytest.raises(BadArgumentError, match="keep_last"):
        Retention(keep_last=bad)
