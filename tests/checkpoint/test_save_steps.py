"""Save in three steps, each callable on its own: stage (host buffers), plan (collective), persist (collective).

Zero-copy staging of contiguous CPU tensors, real snapshots with copy=True, explicit stage -> plan ->
persist across gloo ranks, persist in a background thread, and failures raised on every rank with nothing
half-committed."""
from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import shardckpt
import shardckpt.checkpoint.save as save_mod
from shardckpt import CheckpointExistsError, ShardedTensor, UnsupportedValueError
from shardckpt.checkpoint.collect import local_pieces
from shardckpt.checkpoint.save import Planned, persist, plan, stage
from shardckpt.checkpoint.save_plan import PieceInfo
from shardckpt.checkpoint.stage import Staged
from shardckpt.checkpoint.verify import verify
from shardckpt.checkpoint.writer import write_data_file
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.io import open_storage
from tests._dist import run_ranks
from tests.checkpoint.cases import check_equal, empty_like_state, reference, sharded_state
from tests.storage._util import assert_tree_equal


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _metadata(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return parse_manifest(f.read(), path).metadata


def _scribble(sd: dict) -> None:
    """Change every tensor of a (sharded) state dict in place, and its plain values."""
    for v in sd["model"].values():
        local = v.local if isinstance(v, ShardedTensor) else v
        local.fill_(7)
    sd["step"] = -1
    sd["meta"]["lrs"].append(0.5)


# ------------------------------------------------------------------------------------ stage, one process


def test_stage_shares_contiguous_cpu_tensors_and_copies_the_rest():
    base = torch.arange(24.0).reshape(4, 6)
    sd = {"whole": base, "rows": base[1:3], "cols": base[:, ::2], "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
          "neg": torch._neg_view(torch.tensor([1.0 + 1j, -2.0])), "empty": torch.zeros(0, 3),
          "scalar": torch.tensor(1.5), "param": torch.nn.Parameter(torch.ones(3))}
    staged = stage(sd)
    assert staged.failure is None and isinstance(staged, Staged)
    assert staged.aliased == {"whole", "rows", "scalar", "param"}
    for name, value in sd.items():
        data = staged.pieces[name].data
        assert data.device.type == "cpu" and data.is_contiguous() and not data.is_conj() and not data.is_neg()
        assert torch.equal(data, value.detach().resolve_conj().resolve_neg()), name
        assert staged.buffer(name).dtype == torch.uint8 and staged.buffer(name).numel() == value.nbytes
    # zero-copy: the buffers of contiguous CPU tensors are the caller's memory
    assert staged.buffer("whole").data_ptr() == base.data_ptr()
    assert staged.buffer("rows").data_ptr() == base[1].data_ptr()
    assert staged.nbytes == sum(v.nbytes for v in sd.values())

    snap = stage(sd, copy=True)
    assert snap.aliased == frozenset()
    assert snap.buffer("whole").data_ptr() != base.data_ptr()
    assert all(torch.equal(snap.pieces[n].data, staged.pieces[n].data) for n in sd)


def test_copy_true_is_a_snapshot_and_copy_false_aliases(tmp_path):
    sd = reference()
    want = reference()
    meta = {"run": "a", "lrs": [0.1]}
    snap = stage(sd, copy=True, metadata=meta)
    alias = stage(sd)  # aliases sd's tensors (plain values and metadata are still snapshots)
    _scribble(sd)
    meta["lrs"].append(0.2)
    persist(snap, plan(snap, tmp_path / "snap"))
    assert_tree_equal(shardckpt.load_full(tmp_path / "snap"), want)
    assert _metadata(str(tmp_path / "snap")) == {"run": "a", "lrs": [0.1]}
    # Without copy=True the bytes written are the tensors as they are when persist runs (documented).
    persist(alias, plan(alias, tmp_path / "alias"))
    got = shardckpt.load_full(tmp_path / "alias")
    assert got["step"] == want["step"] and got["meta"] == want["meta"]
    for k, v in sd["model"].items():
        assert torch.equal(got["model"][k], v), k


def test_plan_alone_writes_nothing_and_persist_commits_later(tmp_path):
    path = tmp_path / "ckpt"
    staged = stage(reference())
    planned = plan(staged, path)
    assert isinstance(planned, Planned) and planned.save_plan is not None and planned.tasks
    assert _files(str(path)) == []
    persist(staged, planned)
    assert_tree_equal(shardckpt.load_full(path), reference())
    assert all(f == MANIFEST_NAME or f.startswith(planned.data_dir + "/") for f in _files(str(path)))


def test_plan_refuses_an_existing_checkpoint_and_overwrites_only_when_asked(tmp_path):
    path = tmp_path / "ckpt"
    shardckpt.save(reference(), path)
    before = _files(str(path))
    other = {"x": torch.ones(3)}
    with pytest.raises(CheckpointExistsError):
        plan(stage(other), path)
    assert _files(str(path)) == before
    staged = stage(other)
    persist(staged, plan(staged, path, overwrite=True))
    assert_tree_equal(shardckpt.load_full(path), other)


def test_stage_keeps_its_error_for_plan(tmp_path):
    staged = stage({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})  # does not raise: plan raises it
    assert staged.failure is not None and isinstance(staged.failure.error, UnsupportedValueError)
    with pytest.raises(UnsupportedValueError, match="both named 'a.b'"):
        plan(staged, tmp_path / "ckpt")
    assert _files(str(tmp_path / "ckpt")) == []
    assert stage({"m": {"x": torch.ones(1)}}, metadata={"bad": object()}).failure is not None


def test_the_writer_takes_staged_pieces_only(tmp_path):
    from shardckpt.checkpoint.save_plan import WriteTask

    (piece,) = local_pieces({"t": torch.arange(6.0).reshape(2, 3).t()})  # not contiguous: not staged
    with pytest.raises(ValueError, match="not staged"):
        write_data_file(open_storage(tmp_path, None), "d.bin", "d.index.json", [WriteTask("t", 0)], {"t": piece})


# ------------------------------------------------------------------------------------ across gloo ranks


def _steps_explicitly(path: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    staged = stage(sharded_state(rank, world, 0), metadata={"by": "steps"})
    planned = plan(staged, path, files_per_rank=1)
    assert (planned.save_plan is not None) == (rank == 0)
    persist(staged, planned)
    sd = empty_like_state(rank, world, 1)  # loaded with other shardings than saved
    shardckpt.load(sd, path)
    check_equal(sd, rank, world, 1)
    return len(planned.tasks)


def test_stage_plan_persist_across_two_ranks_is_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    tasks = run_ranks(2, _steps_explicitly, path)
    assert all(tasks)  # both ranks wrote chunks
    assert_tree_equal(shardckpt.load_full(path), reference())
    assert _metadata(path) == {"by": "steps"}
    assert verify(path).ok


def _persist_in_background(path: str) -> tuple[str, bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = sharded_state(rank, world, 0)
    staged = stage(sd, copy=True)
    planned = plan(staged, path)
    gate, ran_in = threading.Event(), []

    def background() -> None:
        ran_in.append(threading.current_thread().name)
        gate.wait(60)
        persist(staged, planned)

    with ThreadPoolExecutor(1, thread_name_prefix="persist") as pool:
        future = pool.submit(background)
        # The main thread goes on: it changes the state dict in place and computes, while persist waits
        # to start (then runs) in the background.
        _scribble(sd)
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))
        for _ in range(20):
            x = torch.tanh(x @ x.T / 64)
        pending = not future.done()
        gate.set()
        future.result(timeout=120)
    loaded = empty_like_state(rank, world, 1)
    shardckpt.load(loaded, path)
    check_equal(loaded, rank, world, 1)  # the values at stage time, not the scribbled ones
    return ran_in[0], pending


def test_persist_in_a_background_thread(tmp_path):
    path = str(tmp_path / "ckpt")
    for thread_name, pending in run_ranks(2, _persist_in_background, path):
        assert thread_name.startswith("persist") and pending
    assert_tree_equal(shardckpt.load_full(path), reference())


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def _stage_fails_on_rank_1(path: str) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = sharded_state(rank, world, 0)
    if rank == 1:
        sd["model.tiny"] = torch.ones(1)  # its name collides with sd["model"]["tiny"]
    staged = stage(sd)
    assert (staged.failure is None) == (rank == 0)
    with pytest.raises(UnsupportedValueError, match="both named 'model.tiny'") as info:
        plan(staged, path)
    # every rank ran the same collectives: the group is in step, and a save works at once
    shardckpt.save(sharded_state(rank, world, 0), path)
    return _notes(info.value)


def test_a_stage_error_on_one_rank_is_raised_by_plan_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    notes = run_ranks(2, _stage_fails_on_rank_1, path)
    assert all("raised on rank 1" in n for n in notes)
    assert_tree_equal(shardckpt.load_full(path), reference())


def _persist_fails_on_rank_1(path: str) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    shardckpt.save(sharded_state(rank, world, 0), path)
    generations = {f for f in os.listdir(path) if f.startswith("data-")}
    dist.barrier()
    other = sharded_state(rank, world, 0)
    _scribble(other)
    staged = stage(other)
    planned = plan(staged, path, overwrite=True)
    real = save_mod.write_rank_files

    def failing(*args, **kwargs):
        real(*args, **kwargs)  # the files are written, then the rank fails
        raise OSError("injected: disk full")

    if rank == 1:
        save_mod.write_rank_files = failing
    try:
        with pytest.raises(OSError, match="injected") as info:
            persist(staged, planned)
    finally:
        save_mod.write_rank_files = real
    dist.barrier()
    # nothing half-committed: the old checkpoint is whole and the failed generation is gone
    assert {f for f in os.listdir(path) if f.startswith("data-")} == generations
    loaded = empty_like_state(rank, world, 0)
    shardckpt.load(loaded, path)
    check_equal(loaded, rank, world, 0)
    return _notes(info.value)


def test_a_persist_error_on_one_rank_is_raised_on_every_rank_and_nothing_is_committed(tmp_path):
    path = str(tmp_path / "ckpt")
    notes = run_ranks(2, _persist_fails_on_rank_1, path)
    assert all("raised on rank 1" in n for n in notes)
    assert_tree_equal(shardckpt.load_full(path), reference())


def test_a_world_of_one_reuses_its_last_plan_while_the_pieces_are_the_same(tmp_path, monkeypatch):
    """``save`` in one process plans a save of the same pieces as its last one did (``plan(reuse=)``: no new
    assignment, no second check of the same tree), and anew when a piece, an option or the tree differs."""
    planned, checked = [], []
    real_plan, real_check = save_mod.make_save_plan, save_mod._check_loadable
    monkeypatch.setattr(save_mod, "make_save_plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(save_mod, "_check_loadable", lambda *a, **k: checked.append(1) or real_check(*a, **k))
    monkeypatch.setattr(save_mod, "_last_plan", None)
    sd = {"w": torch.randn(64, 8), "b": torch.arange(5), "step": 1}
    states = []
    for i in range(3):
        sd["w"].add_(1)
        shardckpt.save(sd, tmp_path / f"s{i}")
        states.append({"w": sd["w"].clone(), "b": sd["b"].clone(), "step": 1})
    assert (len(planned), len(checked)) == (1, 1)
    sd["step"] = 2  # the same pieces, another tree: the plan kept, the tree checked
    shardckpt.save(sd, tmp_path / "s3")
    states.append({"w": sd["w"].clone(), "b": sd["b"].clone(), "step": 2})
    assert (len(planned), len(checked)) == (1, 2)
    shardckpt.save(sd, tmp_path / "s4", files_per_rank=1)  # another option: planned anew
    states.append(states[-1])
    sd["w"] = torch.randn(32, 8)  # another shape
    shardckpt.save(sd, tmp_path / "s5")
    states.append({"w": sd["w"].clone(), "b": sd["b"].clone(), "step": 2})
    assert (len(planned), len(checked)) == (3, 4)
    for i, want in enumerate(states):
        got = shardckpt.load_full(tmp_path / f"s{i}")
        assert got.keys() == want.keys() and got["step"] == want["step"]
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
        assert verify(tmp_path / f"s{i}").ok
    generations = {parse_manifest((tmp_path / f"s{i}" / MANIFEST_NAME).read_bytes(), "").generation for i in range(6)}
    assert len(generations) == 6  # a reused plan writes under a generation of its own


def _saves_with_rank_0s_plan_kept(root: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    planned = []
    real = save_mod.make_save_plan
    save_mod.make_save_plan = lambda *a, **k: planned.append(1) or real(*a, **k)
    save_mod._last_plan = None
    try:
        for i, rotate in enumerate((0, 0, 0, 1, 1)):
            shardckpt.save(sharded_state(rank, world, rotate), f"{root}/s{i}")
            target = empty_like_state(rank, world, rotate)
            shardckpt.load(target, f"{root}/s{i}")
            check_equal(target, rank, world, rotate)
    finally:
        save_mod.make_save_plan = real
    return len(planned)


def test_rank_0_keeps_its_last_plan_while_every_ranks_pieces_are_the_same(tmp_path):
    """Across ranks, rank 0 keeps the last save's assignment while every rank's pieces are as they were (the others
    send their infos, rank 0 compares), and plans anew when they change: each checkpoint loads bit for bit."""
    counts = run_ranks(2, _saves_with_rank_0s_plan_kept, str(tmp_path))
    assert counts == [2, 0]  # rank 0: the first save's plan and the one after the shards changed; rank 1 none
    generations = {parse_manifest((tmp_path / f"s{i}" / MANIFEST_NAME).read_bytes(), "").generation for i in range(5)}
    assert len(generations) == 5


def test_one_ranks_changed_pieces_make_rank_0_plan_anew():
    """The reuse is decided on every rank's infos: rank 1's alone differing is enough (no stale assignment)."""
    old = [[PieceInfo("w", "float32", (8, 4), ("flat", 0, 16), False, True)],
           [PieceInfo("w", "float32", (8, 4), ("flat", 16, 32), False, True)]]
    new = [old[0], [PieceInfo("w", "float32", (8, 4), ("flat", 16, 24), False, True)]]
    reuse = dataclasses.replace(_planned_stub(), gathered=old, files_per_rank=2, compression=None)
    assert save_mod._with_reused(old, reuse, 2, None) == (old, reuse.save_plan)
    assert save_mod._with_reused(new, reuse, 2, None) == (new, None)
    assert save_mod._with_reused(old, reuse, 1, None) == (old, None)  # another option
    assert save_mod._with_reused(old[:1], reuse, 2, None) == (old[:1], None)  # another world size


def _planned_stub() -> Planned:
    return Planned(group=None, storage=None, generation="g", tasks=[], files_per_rank=2, compression=None,
                   save_plan=object(), overwrite=False, infos=[])
