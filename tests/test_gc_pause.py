"""The cyclic collector is paused while a save or load runs, and given back as it was, across nesting and threads."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

import shardckpt
from shardckpt.gc_pause import gc_paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_enabled_after_even_on_error():
    seen = []

    @gc_paused
    def fails():
        seen.append(gc.isenabled())
        raise ValueError("boom")

    with pytest.raises(ValueError):
        fails()
    assert seen == [False] and gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    gc_paused(lambda: None)()
    assert not gc.isenabled()


def test_overlapping_pauses_from_two_threads_end_with_the_last():
    entered, release_first, release_second = threading.Barrier(3), threading.Event(), threading.Event()

    @gc_paused
    def hold(until: threading.Event):
        entered.wait()
        until.wait(10)

    first = threading.Thread(target=hold, args=(release_first,))
    second = threading.Thread(target=hold, args=(release_second,))
    first.start(), second.start()
    entered.wait()
    release_first.set()
    first.join()
    assert not gc.isenabled()  # the second pause still runs
    release_second.set()
    second.join()
    assert gc.isenabled()


def test_save_and_load_run_paused_and_give_the_collector_back(tmp_path):
    during = []
    state = {"w": torch.arange(10.0), "nested": {"b": torch.ones(3, dtype=torch.bfloat16)}}
    shardckpt.save(state, tmp_path / "c", progress=lambda done, total: during.append(gc.isenabled()))
    assert during and not any(during) and gc.isenabled()
    loaded = shardckpt.load_full(tmp_path / "c")
    assert gc.isenabled()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["nested"]["b"], state["nested"]["b"])


def test_an_interrupted_pause_is_healed_by_the_next_one(monkeypatch):
    """A KeyboardInterrupt just after the collector was turned off, before the pause counted itself: the next
    pause's end turns it back on."""
    from shardckpt import gc_pause

    real_disable = gc.disable

    def disable_then_interrupt():
        real_disable()
        raise KeyboardInterrupt

    monkeypatch.setattr(gc_pause.gc, "disable", disable_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        gc_paused(lambda: None)()
    monkeypatch.setattr(gc_pause.gc, "disable", real_disable)
    gc_paused(lambda: None)()
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_its_collector_back():
    import os

    inside = threading.Event()
    release = threading.Event()

    @gc_paused
    def hold():
        inside.set()
        release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(10)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(write)
        child_enabled = os.read(read, 1)
        os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert child_enabled == b"1" and gc.isenabled()


def test_convert_runs_paused(tmp_path):
    during = []
    shardckpt.save({"w": torch.arange(6.0)}, tmp_path / "a")
    shardckpt.convert(tmp_path / "a", tmp_path / "b", world_size=2,
                      progress=lambda done, total: during.append(gc.isenabled()))
    assert during and not any(during) and gc.isenabled()


def test_the_stage_step_runs_paused_plan_and_persist_with_the_collector_on(tmp_path, monkeypatch):
    """``stage`` runs in the caller's thread and pauses the collector as ``save`` does; ``plan`` and ``persist`` also
    run in an async save's background thread, where a pause would stop collection for the whole process, the caller's
    training included, for as long as the background waits (a slow callback, a late rank): they keep it on
    (shardckpt.gc_pause)."""
    from shardckpt.checkpoint import save as save_module
    seen: dict[str, list[bool]] = {"stage": [], "plan": [], "persist": []}
    make_save_plan = save_module.make_save_plan

    def planning(*args, **kwargs):
        seen["plan"].append(gc.isenabled())
        return make_save_plan(*args, **kwargs)

    def skip(piece) -> bool:
        seen["stage"].append(gc.isenabled())
        return False

    monkeypatch.setattr(save_module, "make_save_plan", planning)
    state = {"w": torch.arange(10.0), "b": torch.ones(3)}
    staged = save_module.stage(state, skip=skip)
    assert gc.isenabled()
    planned = save_module.plan(staged, tmp_path / "c")
    save_module.persist(staged, planned, progress=lambda done, total: seen["persist"].append(gc.isenabled()))
    assert seen["stage"] == [False, False] and seen["plan"] == [True] and seen["persist"] and all(seen["persist"])
    assert gc.isenabled() and torch.equal(shardckpt.load_full(tmp_path / "c")["w"], state["w"])


def test_a_collector_disabled_after_an_async_save_returns_stays_disabled(tmp_path):
    """The background writing never pauses the collector: a ``gc.disable()`` the caller makes while it runs is kept."""
    state = {f"t{i}": torch.full((8,), float(i)) for i in range(200)}
    for step in range(5):
        handle = shardckpt.async_save(state, str(tmp_path / f"s{step}"), progress=lambda done, total: None)
        gc.disable()
        handle.wait()
        assert not gc.isenabled(), step
        gc.enable()
