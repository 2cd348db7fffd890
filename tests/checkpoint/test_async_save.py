"""Asynchronous save (issue 11): blocked only while staging, value semantics, errors never dropped."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import ShardedTensor
from shardckpt.checkpoint import async_save as async_module
from shardckpt.checkpoint import save_plan
from shardckpt.checkpoint.verify import verify
from tests._helpers import load_state_matches
from tests._dist import run_ranks
from tests.storage._util import assert_tree_equal


def _state(rank: int, world: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(37, 11, generator=g)
    flat = torch.randn(1001, generator=g)
    return {"model": {"w": ShardedTensor.from_full(full, rank, world), "flat": ShardedTensor.even_flat_shard(flat, rank, world),
                      "bias": torch.randn(5, generator=g), "half": torch.randn(6, 2, generator=g).half().t()},
            "step": 3, "lrs": [0.1, 0.2]}


def _snapshot(sd):
    if isinstance(sd, ShardedTensor):
        return ShardedTensor(sd.local.clone(), sd.global_shape, sd.region)
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _snapshot(v) for k, v in sd.items()}
    return list(sd) if isinstance(sd, list) else sd


def _mutate(sd) -> None:
    for v in sd["model"].values():
        (v.local if isinstance(v, ShardedTensor) else v).add_(1)
    sd["lrs"].append(9)


def _in_place_updates_do_not_leak(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _state(rank, world)
    want = _snapshot(sd)
    handle = shardckpt.async_save(sd, f"{root}/a")
    _mutate(sd)  # the next optimizer step, at once
    handle.wait()
    assert handle.done()
    got = {"model": {k: torch.zeros_like(v) if not isinstance(v, ShardedTensor) else
                     ShardedTensor(torch.zeros_like(v.local), v.global_shape, v.region) for k, v in want["model"].items()},
           "step": 0, "lrs": []}
    shardckpt.load(got, f"{root}/a")
    for k, v in want["model"].items():
        g = got["model"][k]
        assert torch.equal(g.local if isinstance(g, ShardedTensor) else g, v.local if isinstance(v, ShardedTensor) else v), k
    assert got["lrs"] == [0.1, 0.2]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_in_place_updates_after_the_call_do_not_leak(tmp_path, world):
    run_ranks(world, _in_place_updates_do_not_leak, str(tmp_path))


def _train_while_committing(root: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _state(rank, world)
    sums = []
    for i in range(3):
        handle = shardckpt.async_save(sd, f"{root}/step-{i}")
        for j in range(50):  # the training's collectives on the default group, while the background commits
            t = torch.full((1000,), float(rank + j))
            dist.all_reduce(t)
            assert torch.all(t == sum(r + j for r in range(world))), (i, j)
            dist.broadcast_object_list(box := [("tick", i, j) if rank == 0 else None], src=0)
            assert box[0] == ("tick", i, j)
        sums.append(float(t.sum()))
        handle.wait()
    return sums


@pytest.mark.parametrize("world", [2, 3])
def test_training_collectives_during_the_background_commit_neither_hang_nor_mix(tmp_path, world):
    run_ranks(world, _train_while_committing, str(tmp_path), timeout=120)
    for i in range(3):
        assert verify(str(tmp_path / f"step-{i}")).ok


def _reuse(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    real = save_plan.make_save_plan
    import shardckpt.checkpoint.save as save_module
    save_module.make_save_plan = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        saver = async_module.AsyncSaver()
        sd = _state(rank, world)
        for i in range(3):
            saver.save(sd, f"{root}/r{i}").wait()
        steady = (saver.buffers.allocations, len(calls), saver.staging_bytes)
        sd["model"]["bias"] = torch.randn(8)  # a new shape: one buffer reallocated, planned again
        saver.save(sd, f"{root}/r3").wait()
        changed = (saver.buffers.allocations, len(calls))
        saver.release()
        released = saver.staging_bytes
    finally:
        save_module.make_save_plan = real
    return {"steady": steady, "changed": changed, "released": released, "rank": rank}


def test_staging_buffers_and_the_plan_are_reused(tmp_path):
    results = run_ranks(2, _reuse, str(tmp_path))
    for r in results:
        allocations, planned, staged = r["steady"]
        assert allocations == 4  # w, flat, bias, half: once, on the first save only
        assert planned == (1 if r["rank"] == 0 else 0)  # rank 0 planned the first save only
        assert staged > 0
        assert r["changed"] == (5, 2 if r["rank"] == 0 else 0)
        assert r["released"] == 0
    for i in range(4):
        assert verify(str(tmp_path / f"r{i}")).ok
    assert shardckpt.load_full(str(tmp_path / "r3"))["model"]["bias"].shape == (8,)


def test_a_background_failure_surfaces_on_wait_and_on_the_next_call(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    saver = async_module.AsyncSaver()
    sd = {"w": torch.arange(10.0)}
    handle = saver.save(sd, str(blocker / "ckpt"))
    with pytest.raises(OSError):
        handle.wait()
    # Nobody waits: the next call raises it, and the one after works.
    saver.save(sd, str(blocker / "ckpt"))
    with pytest.raises(OSError):
        saver.save(sd, str(tmp_path / "ok"))
    saver.save(sd, str(tmp_path / "ok")).wait()
    assert torch.equal(shardckpt.load_full(str(tmp_path / "ok"))["w"], sd["w"])


def test_one_save_at_a_time(tmp_path, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(async_module, "persist", _gated(async_module.persist, gate))
    saver = async_module.AsyncSaver()
    first = saver.save({"w": torch.ones(3)}, str(tmp_path / "a"))
    assert not first.done()
    threading.Timer(0.3, gate.set).start()
    second = saver.save({"w": torch.zeros(3)}, str(tmp_path / "b"))  # waits for the first
    assert first.done()
    second.wait()
    assert torch.equal(shardckpt.load_full(str(tmp_path / "a"))["w"], torch.ones(3))
    assert torch.equal(shardckpt.load_full(str(tmp_path / "b"))["w"], torch.zeros(3))


def _gated(fn, gate: threading.Event):
    def gated(*args, **kwargs):
        gate.wait(10)
        return fn(*args, **kwargs)
    return gated


_KILLER = textwrap.dedent("""
    import os, signal, sys, threading
    import torch
    import shardckpt
    from shardckpt.checkpoint import writer

    path = sys.argv[1]
    shardckpt.save({"w": torch.arange(1 << 20, dtype=torch.float32), "v": 1}, path)
    returned = threading.Event()

    def write_then_die(w, data, block, *_):
        w.write(data[:len(data) // 2])
        returned.wait(10)
        os.kill(os.getpid(), signal.SIGKILL)

    writer._write_raw = write_then_die
    handle = shardckpt.async_save({"w": torch.zeros(1 << 20), "v": 2}, path, overwrite=True)
    print("returned", flush=True)
    returned.set()
    handle.wait()
    print("not killed", flush=True)
""")


def test_kill_9_in_the_background_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _KILLER, path], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.split() == ["returned"]
    got = shardckpt.load_full(path)
    assert got["v"] == 1 and torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert verify(path).ok


def _save_state_async(path: str, sd_type: str) -> dict:
    from shardckpt import StateDictType
    from tests.runtime import _model
    from tests.state_dict._train import STEPS_BEFORE, full_state, new_run, steps

    model, optim = new_run()
    steps(model, optim, _model.make_batches(STEPS_BEFORE))
    want = full_state(model, optim)
    handle = shardckpt.async_save_state(model, optim, path, type=StateDictType[sd_type])
    steps(model, optim, _model.make_batches(STEPS_BEFORE + 2)[STEPS_BEFORE:])  # train on at once
    handle.wait()
    return want


@pytest.mark.parametrize("sd_type", ["LOCAL_STATE_DICT", "SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_async_save_state_holds_the_state_at_the_call(tmp_path, sd_type):
    path = str(tmp_path / sd_type)
    want = run_ranks(2, _save_state_async, path, sd_type)[0]
    run_ranks(3, load_state_matches, path, want, f"async save of {path}")


def test_async_save_takes_save_options(tmp_path):
    sd = {"w": (torch.randn(50_000) * 0.02).bfloat16()}
    shardckpt.async_save(sd, str(tmp_path / "z"), compress="zstd", metadata={"k": 1}).wait()
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "z")), sd)
    with pytest.raises(shardckpt.CheckpointExistsError):
        shardckpt.async_save(sd, str(tmp_path / "z")).wait()


def _errors_agree(root: str) -> list[str]:
    """Rank 0 looks at a failed save's error, rank 1 does not: the next call raises on both, or on neither."""
    rank = dist.get_rank()
    saver = async_module.AsyncSaver()
    blocker = os.path.join(root, "file")
    if rank == 0:
        open(blocker, "w").write("not a directory")
    dist.barrier()
    seen = []
    handle = saver.save({"w": torch.ones(4)}, os.path.join(blocker, "ckpt"))
    if rank == 0:
        seen.append(type(handle.exception()).__name__)
    try:
        saver.save({"w": torch.ones(4)}, os.path.join(root, "next"))
        seen.append("saved")
    except OSError:
        seen.append("raised")
    saver.save({"w": torch.full((4,), 2.0)}, os.path.join(root, "after"), overwrite=True).wait()
    return seen


def test_ranks_agree_on_raising_a_previous_error(tmp_path):
    seen = run_ranks(2, _errors_agree, str(tmp_path), timeout=60)
    assert seen[0][-1] == seen[1][-1] == "raised"
    assert torch.equal(shardckpt.load_full(str(tmp_path / "after"))["w"], torch.full((4,), 2.0))


def _bad_option_after_reuse(root: str) -> str:
    saver = async_module.AsyncSaver()
    sd = _state(dist.get_rank(), dist.get_world_size())
    for i in range(2):
        saver.save(sd, f"{root}/ok{i}").wait()
    handle = saver.save(sd, f"{root}/bad", compress="bogus")
    with pytest.raises(ValueError, match="compress must be"):
        handle.wait()
    saver.save(sd, f"{root}/ok2").wait()
    return "done"


def test_a_bad_option_with_a_reused_plan_raises_on_every_rank(tmp_path):
    assert run_ranks(2, _bad_option_after_reuse, str(tmp_path), timeout=60) == ["done", "done"]


def _after_a_subgroup(root: str) -> str:
    # Ranks 0 and 1 know one more group than rank 2: a group made by some ranks only would get different
    # names on them and hang.
    if dist.get_rank() < 2:
        dist.new_group([0, 1], use_local_synchronization=True)
    saver = async_module.AsyncSaver()
    saver.save(_state(dist.get_rank(), 3), f"{root}/c").wait()
    sub = dist.new_group([0, 1])  # every rank of the world calls this
    if dist.get_rank() < 2:
        with pytest.raises(ValueError, match="background group"):
            async_module.AsyncSaver(sub)
    return "done"


def test_the_side_group_is_made_the_same_way_on_every_rank(tmp_path):
    assert run_ranks(3, _after_a_subgroup, str(tmp_path), timeout=60) == ["done"] * 3


_EXITS = textwrap.dedent("""
    import sys, torch, shardckpt
    shardckpt.async_save({"w": torch.arange(4 << 20, dtype=torch.float32)}, sys.argv[1])
    # the interpreter exits with the save in flight
""")


def test_a_save_in_flight_at_exit_is_finished(tmp_path):
    path = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _EXITS, path], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(shardckpt.load_full(path)["w"], torch.arange(4 << 20, dtype=torch.float32))


_DESTROYS = textwrap.dedent("""
    import gc, os, sys, threading, weakref
    import torch, torch.distributed as dist
    side = None

    def check():  # registered before shardckpt's exit hook, so it runs after it
        gc.collect()
        print("side group", "alive" if side() is not None else "freed")

    threading._register_atexit(check)
    import shardckpt
    from shardckpt.checkpoint.async_save import saver_for

    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shardckpt.async_save({"w": shardckpt.ShardedTensor.from_full(torch.arange(10.0), rank, 2)}, path).wait()
    side = weakref.ref(saver_for().side.pg)
    dist.destroy_process_group()
""")


def test_the_side_group_is_freed_before_the_interpreter_finalizes(tmp_path):
    # Left to finalization, the last reference to the gloo side group (after destroy_process_group) aborted
    # about one exit in five on a loaded machine ("terminate called without an active exception").
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", _DESTROYS, str(rank), str(tmp_path / "ckpt")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
        assert "side group freed" in out, out + err
    assert torch.equal(shardckpt.load_full(str(tmp_path / "ckpt"))["w"], torch.arange(10.0))


_IN_FLIGHT_AT_DESTROY = textwrap.dedent("""
    import os, sys, threading, time
    import torch, torch.distributed as dist
    import shardckpt
    from shardckpt.checkpoint import async_save as async_module

    def in_destroy() -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == "destroy_process_group":
                return True
            frame = frame.f_back
        return False

    real = async_module.persist

    def persist_once_destroy_began(*args, **kwargs):
        # Deterministically in flight at the destroy: the write starts once the main thread is inside
        # destroy_process_group (or once the groups are gone, which is how the save was lost).
        while not in_destroy() and dist.is_initialized():
            time.sleep(0.01)
        return real(*args, **kwargs)

    async_module.persist = persist_once_destroy_began
    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    full = torch.arange(1 << 16, dtype=torch.float32)
    shardckpt.async_save({"w": shardckpt.ShardedTensor.from_full(full, rank, 2), "step": 7}, path)
    dist.destroy_process_group()  # no wait(): the README example's last lines without it
    print("destroyed", flush=True)
""")


def _run_pair(script: str, *args: str) -> list[tuple[int, str, str]]:
    """Run ``script`` as ranks 0 and 1 of a gloo world of two real processes; (status, stdout, stderr) each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outs)]


def test_destroy_process_group_finishes_the_save_in_flight(tmp_path):
    # It destroyed the side group under the save: "Group ... is not registered", nothing committed, exit 0.
    path = str(tmp_path / "ckpt")
    for status, out, err in _run_pair(_IN_FLIGHT_AT_DESTROY, path):
        assert status == 0 and "destroyed" in out, err
        assert "failed" not in err, err
    got = shardckpt.load_full(path)
    assert got["step"] == 7 and torch.equal(got["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert verify(path).ok


def test_a_save_failing_in_flight_at_destroy_raises_there_on_every_rank(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    path = str(tmp_path / "file" / "ckpt")
    for status, out, err in _run_pair(_IN_FLIGHT_AT_DESTROY, path):
        assert status == 1 and "destroyed" not in out, (out, err)
        assert "NotADirectoryError" in err and f"the async save to {path}, in flight at " \
            "destroy_process_group(), failed: nothing was committed there" in err, err


_EXIT_AFTER = textwrap.dedent("""
    import atexit, sys, torch, shardckpt
    atexit.register(lambda: print("the program's own exit handler ran", flush=True))
    path, how, log = sys.argv[1], sys.argv[2], sys.argv[3]
    log = open(log, "w")  # left open, as many training scripts leave their logs
    log.write("step 9 loss 0.1\\n")  # buffered, written when the interpreter finalizes
    shardckpt.async_save({"w": torch.arange(1 << 20, dtype=torch.float32), "step": 9}, path)
    if how == "raise":
        raise RuntimeError("the training loop raised")
    if how == "sys.exit":
        sys.exit(0)
""")


@pytest.mark.parametrize("how", ["end", "sys.exit", "raise"])
def test_a_save_in_flight_at_exit_is_finished_however_the_program_ends(tmp_path, how):
    path = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _EXIT_AFTER, path, how, str(tmp_path / "log")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == (1 if how == "raise" else 0), proc.stderr
    assert "the program's own exit handler ran" in proc.stdout
    got = shardckpt.load_full(path)
    assert got["step"] == 9 and torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("how", ["end", "sys.exit"])
def test_a_save_failing_in_flight_at_exit_makes_the_exit_status_1(tmp_path, how):
    # It printed the error and exited 0: a lost checkpoint reported as success.
    (tmp_path / "file").write_text("not a directory")
    path = str(tmp_path / "file" / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _EXIT_AFTER, path, how, str(tmp_path / "log")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 1, proc.stderr
    assert f"shardckpt: the async save to {path} failed: NotADirectoryError" in proc.stderr
    assert "nothing was committed there" in proc.stderr
    assert "the program's own exit handler ran" in proc.stdout  # the other exit handlers still run
    with open(tmp_path / "log") as f:
        assert f.read() == "step 9 loss 0.1\n"  # what the program left buffered is not lost to the exit


def _a_late_failure_on_one_rank(root: str) -> list[str]:
    """Rank 1's save fails after the commit (its own tidy-up): both handles fail, and the next call, which has
    to agree on raising, does not hang."""
    from shardckpt.checkpoint import save as save_module
    rank = dist.get_rank()
    saver = async_module.AsyncSaver()
    end = save_module._Saved.end

    def failing_end(self):
        end(self)
        raise OSError("tidy-up failed on rank 1")

    if rank == 1:
        save_module._Saved.end = failing_end
    try:
        handle = saver.save({"w": torch.ones(4)}, os.path.join(root, "a"))
        outcome = [type(handle.exception()).__name__]
    finally:
        save_module._Saved.end = end
    saver.save({"w": torch.full((4,), 2.0)}, os.path.join(root, "b")).wait()
    return outcome


def test_a_failure_on_one_rank_after_the_commit_fails_every_rank(tmp_path):
    assert run_ranks(2, _a_late_failure_on_one_rank, str(tmp_path), timeout=60) == [["OSError"], ["OSError"]]
    assert torch.equal(shardckpt.load_full(str(tmp_path / "b"))["w"], torch.full((4,), 2.0))


def _blocked_after_a_late_peer(root: str) -> float:
    import time
    saver = async_module.AsyncSaver()
    saver.save({"w": torch.ones(4)}, os.path.join(root, "a")).wait()
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(1.5)  # the training of rank 1 is behind
    start = time.perf_counter()
    handle = saver.save({"w": torch.ones(4)}, os.path.join(root, "b"))
    blocked = time.perf_counter() - start
    handle.wait()
    return blocked


def test_a_call_after_a_successful_save_does_not_wait_for_the_other_ranks(tmp_path):
    # Only staging blocks the caller: no collective in the call (rank 0 does not wait for the late rank 1).
    blocked = run_ranks(2, _blocked_after_a_late_peer, str(tmp_path), timeout=60)
    assert blocked[0] < 0.5, blocked
    assert torch.equal(shardckpt.load_full(str(tmp_path / "b"))["w"], torch.ones(4))


class _TwoArgError(Exception):
    """Pickles, but does not unpickle (its __init__ takes other arguments than its args), like many libraries'."""

    def __init__(self, what, code):
        super().__init__(f"{what} (code {code})")


def _an_error_that_does_not_travel(root: str) -> list[str]:
    rank = dist.get_rank()
    sd = {f"t{i}": torch.arange(4000, dtype=torch.float32) + i for i in range(4)}

    def progress(done, total):
        if rank == 1:
            raise _TwoArgError("quota exceeded", 7)

    seen = []
    for kind in ("sync", "async"):
        try:
            if kind == "sync":
                shardckpt.save(sd, os.path.join(root, "sync"), progress=progress)
            else:
                shardckpt.async_save(sd, os.path.join(root, "async"), progress=progress).wait(30)
            seen.append(f"{kind}: saved")
        except shardckpt.CheckpointError as e:
            seen.append(f"{kind}: {e}".split("\n")[0])
    shardckpt.async_save(sd, os.path.join(root, "after")).wait(30)
    return seen


def test_an_error_that_does_not_unpickle_fails_every_rank_without_a_hang(tmp_path):
    seen = run_ranks(2, _an_error_that_does_not_travel, str(tmp_path), timeout=90)
    for kind, got in zip(("sync", "async"), zip(*seen)):
        assert all(g.startswith(f"{kind}: _TwoArgError: quota exceeded (code 7)") for g in got), got
    assert not os.path.exists(tmp_path / "sync" / "manifest.json") and not os.path.exists(tmp_path / "async" / "manifest.json")
    assert torch.equal(shardckpt.load_full(str(tmp_path / "after"))["t1"], torch.arange(4000, dtype=torch.float32) + 1)
