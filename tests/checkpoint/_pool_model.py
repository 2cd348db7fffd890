"""An exhaustive model of the pool protocols (docs/design/incremental.md, "Collection by reachability"): an
incremental save, a collector and an ``rm`` as sequences of atomic store operations, every interleaving of them
explored, each actor also killed (kill -9) after any of its steps. The decisions are the real ones
(``checkpoint.reachability``); the store is a few sets. The invariant, checked in every reachable state: every
committed manifest's files exist.

Object stores: saver = put lease, list markers, check its references exist, write, commit, delete lease; collector =
list leases, list manifests and files (candidates), put marker, list leases, list manifests, delete (one file a
step), delete marker. Local disk: saver = hold its generations (shared flock; blocks while a collector holds one
exclusively), check, write, commit, release; collector = lock every generation no one holds, list manifests,
delete, unlock. A killed local process lets go of its locks; a killed object-store saver leaves its lease.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shardckpt.checkpoint.reachability import (
    Lease, ManifestRefs, PoolEntry, SweepMarker, generation_of, referenced, sweep_candidates, sweep_deletions,
    usable_references,
)

F0, F1, G, DEAD = "data-a/f0.bin", "data-a/f1.bin", "data-b/g.bin", "data-c/dead.bin"
WANTS = frozenset({F0})  # the save references the parent's f0


@dataclass
class Store:
    files: set[str] = field(default_factory=lambda: {F0, F1, G, DEAD})
    manifests: dict[str, ManifestRefs] = field(default_factory=lambda: {
        "step-1": ManifestRefs("step-1", "a", frozenset({F0, F1})), "step-0": ManifestRefs("step-0", "b", frozenset({G}))})
    leases: dict[str, Lease] = field(default_factory=dict)
    markers: dict[str, SweepMarker] = field(default_factory=dict)
    locks: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)  # generation -> (mode, holders)

    def key(self) -> tuple:
        return (frozenset(self.files), frozenset(self.manifests.items()), frozenset(self.leases.items()),
                frozenset(self.markers.items()), frozenset(self.locks.items()))

    def copy(self) -> Store:
        return Store(set(self.files), dict(self.manifests), dict(self.leases), dict(self.markers), dict(self.locks))

    def broken(self) -> list[str]:
        return [f"{m.checkpoint} names missing {sorted(m.files - self.files)}" for m in self.manifests.values()
                if not m.files <= self.files]


AGAIN = "again"  # a step that ran and runs again (one deletion at a time)
Step = Callable[[Store, dict], object]  # returns True (done: next step), False (blocked) or AGAIN


@dataclass(frozen=True)
class Actor:
    name: str
    steps: tuple[Step, ...]
    on_kill: Callable[[Store], None] = lambda store: None


# ---- object stores ---------------------------------------------------------------------------------------------

def _lease(store, me):
    store.leases["5"] = Lease("5", "step-2", WANTS, 0.0)
    return True


def _list_markers(store, me):
    me["markers"] = tuple(store.markers.values())
    return True


def _check(store, me):
    me["use"] = usable_references(WANTS, me.get("markers", ()), store.files)
    return True


def _write(store, me):
    store.files |= {"data-5/new.bin"} | {f"data-5/re-{p.split('/')[1]}" for p in WANTS - me["use"]}
    return True


def _commit(store, me):
    own = frozenset(f for f in store.files if generation_of(f) == "5")
    store.manifests["step-2"] = ManifestRefs("step-2", "5", frozenset(me["use"]) | own)
    return True


def _unlease(store, me):
    store.leases.pop("5", None)
    return True


def saver_s3(order: tuple[Step, ...] = (_lease, _list_markers, _check, _write, _commit, _unlease)) -> Actor:
    return Actor("saver", order)


def _list_leases_1(store, me):
    me["l1"] = tuple(store.leases.values())
    return True


def _candidates(store, me):
    pool = [PoolEntry(f, 1e9) for f in store.files]
    me["cands"] = sweep_candidates(pool, store.manifests.values(), me.get("l1", ()), 0.0)
    return True


def _marker(store, me):
    store.markers["g"] = SweepMarker("g", me["cands"], 0.0)
    return True


def _list_leases_2(store, me):
    me["l2"] = tuple(store.leases.values())
    return True


def _list_manifests_2(store, me):
    me["r2"] = tuple(store.manifests.values())
    return True


def _decide(store, me):
    me["dels"] = sorted(sweep_deletions(me["cands"], me.get("l2", ()), me.get("r2", ())))
    return True


def _delete_one(store, me):
    if not me["dels"]:
        return True
    store.files.discard(me["dels"].pop(0))
    return AGAIN if me["dels"] else True


def _unmark(store, me):
    store.markers.pop("g", None)
    return True


GC_S3 = (_list_leases_1, _candidates, _marker, _list_leases_2, _list_manifests_2, _decide, _delete_one, _unmark)


def collector_s3(order: tuple[Step, ...] = GC_S3) -> Actor:
    return Actor("gc", order)


def _rm(store, me):
    store.manifests.pop("step-1", None)
    return True


RM = Actor("rm", (_rm,))


# ---- local disk --------------------------------------------------------------------------------------------------

def _hold_shared(gens: tuple[str, ...]) -> Step:
    def step(store, me):
        if any(store.locks.get(g, ("sh", frozenset()))[0] == "ex" for g in gens):
            return False  # flock(LOCK_SH) waits for the collector's exclusive lock
        for g in gens:
            store.locks[g] = ("sh", store.locks.get(g, ("sh", frozenset()))[1] | {"saver"})
        return True
    return step


def _release(holder: str) -> Callable[[Store], None]:
    def release(store):
        for g, (mode, holders) in list(store.locks.items()):
            if holder in holders:
                rest = holders - {holder}
                if rest:
                    store.locks[g] = (mode, rest)
                else:
                    del store.locks[g]
    return release


def _check_local(store, me):
    me["use"] = WANTS & store.files
    return True


def _release_step(holder: str) -> Step:
    def step(store, me):
        _release(holder)(store)
        return True
    return step


def saver_local(order: tuple[Step, ...] | None = None) -> Actor:
    steps = order or (_hold_shared(("a", "5")), _check_local, _write, _commit, _release_step("saver"))
    return Actor("saver", steps, _release("saver"))


def _lock_free_generations(store, me):
    gens = {generation_of(f) for f in store.files}
    me["locked"] = frozenset(g for g in gens if g not in store.locks)  # LOCK_EX | LOCK_NB: skip what is held
    for g in me["locked"]:
        store.locks[g] = ("ex", frozenset({"gc"}))
    return True


def _list_manifests_local(store, me):
    me["r"] = tuple(store.manifests.values())
    return True


def _decide_local(store, me):
    live = referenced(me["r"])
    me["dels"] = sorted(f for f in store.files if generation_of(f) in me["locked"] and f not in live)
    return True


GC_LOCAL = (_lock_free_generations, _list_manifests_local, _decide_local, _delete_one, _release_step("gc"))


def collector_local(order: tuple[Step, ...] = GC_LOCAL) -> Actor:
    return Actor("gc", order, _release("gc"))


# ---- exploring every interleaving --------------------------------------------------------------------------------

@dataclass
class Outcome:
    states: int
    violation: list[str] | None  # the trace to the first broken state
    committed_with_reference: bool  # some run committed the save referencing f0 (the model is not vacuous)
    collected_debris: bool  # some run deleted the unreferenced file


def explore(actors: list[Actor], kills: bool = True) -> Outcome:
    """Every interleaving of ``actors``' steps (and, with ``kills``, of each one's death after any step)."""
    seen: set = set()
    outcome = Outcome(0, None, False, False)

    def key(store, pcs, locals_):
        return store.key(), pcs, tuple(tuple(sorted((k, repr(v)) for k, v in m.items())) for m in locals_)

    def visit(store: Store, pcs: tuple, locals_: tuple, trace: list[str]) -> None:
        if outcome.violation is not None:
            return
        k = key(store, pcs, locals_)
        if k in seen:
            return
        seen.add(k)
        outcome.states += 1
        if store.broken():
            outcome.violation = trace + store.broken()
            return
        step2 = store.manifests.get("step-2")
        outcome.committed_with_reference |= step2 is not None and F0 in step2.files
        outcome.collected_debris |= DEAD not in store.files
        for i, actor in enumerate(actors):
            pc = pcs[i]
            if pc is None or pc >= len(actor.steps):
                continue
            nxt, me = store.copy(), dict(locals_[i])
            ran = actor.steps[pc](nxt, me)
            if ran:
                new_pc = pc if ran == AGAIN else pc + 1
                visit(nxt, pcs[:i] + (new_pc,) + pcs[i + 1:], locals_[:i] + (me,) + locals_[i + 1:],
                      trace + [f"{actor.name}.{actor.steps[pc].__name__}"])
            if kills:
                dead = store.copy()
                actor.on_kill(dead)
                visit(dead, pcs[:i] + (None,) + pcs[i + 1:], locals_, trace + [f"kill {actor.name}"])

    visit(Store(), tuple(0 for _ in actors), tuple({} for _ in actors), [])
    return outcome
