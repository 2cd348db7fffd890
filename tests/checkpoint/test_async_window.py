"""An incremental ``async_save`` leaves unstaged the CPU pieces it proves unchanged in the blocked window
(``checkpoint.window_hash``; docs/design/incremental.md 5.2): what it skips, and that every checkpoint still holds
the values of the instant ``async_save`` returned, whatever writes the caller makes around it."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import shardckpt
from shardckpt.checkpoint import async_save as async_module
from shardckpt.checkpoint.async_save import AsyncSaver
from shardckpt.errors import CheckpointError
from tests._dist import run_ranks
from tests.checkpoint.test_incremental import assert_bits, new_bytes

UNIT = 64 << 10


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"base": torch.randn(512, 256, generator=g), "emb": torch.randn(300, 40, generator=g).to(torch.bfloat16),
            "lora": torch.randn(16, 8, generator=g), "mask": torch.arange(1000) % 3 == 0, "zero_d": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "step": 1}


def snapshot(sd: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def save(saver: AsyncSaver, sd: dict, path, **kw):
    return saver.save(sd, path, incremental=True, incremental_unit=UNIT, **kw)


@pytest.fixture
def saver():
    saver = AsyncSaver()
    yield saver
    saver.close()


def test_unchanged_pieces_are_not_staged_and_every_step_holds_its_instant(saver, tmp_path):
    sd, want, copied, held = state(), [], [], []
    for step in range(5):
        handle = save(saver, sd, tmp_path / f"step-{step}")
        want.append(snapshot(sd))
        copied.append(saver.buffers.copied_bytes)
        sd["lora"].add_(1)  # bumped: copied in every window
        if step == 1:
            sd["base"].data[0, 0] += 1  # after the window, no bump: the next window's hash sees it
        handle.wait()
        held.append(saver.staging_bytes)
    base, lora = sd["base"].nbytes, sd["lora"].nbytes
    # 0: nothing to compare against yet; 2: the window's hash found base changed; else base, emb, mask and the 0-d
    # were hashed, equal, and not copied
    assert [c >= base for c in copied] == [True, False, True, False, False]
    assert copied[1] == copied[3] == copied[4] == lora
    assert held[4] == lora and held[3] > base  # a buffer is freed after two saves without it, kept after one
    for step in range(5):
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), want[step])
        assert shardckpt.verify(tmp_path / f"step-{step}").ok
    assert new_bytes(tmp_path / "step-4") == lora  # nothing unchanged written again


@pytest.mark.parametrize("write", ["data", "numpy", "storage", "unsafe_preserve"])
def test_a_write_that_does_not_bump_the_version_is_still_saved(saver, tmp_path, write):
    """The counter is only a hint: a piece it calls unchanged is hashed, and a changed one copied."""
    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    save(saver, sd, tmp_path / "step-1").wait()  # the window now has every piece's digest
    base = sd["base"]
    before = base._version
    if write == "data":
        base.data.mul_(2)
    elif write == "numpy":
        base.numpy()[:7] = 0
    elif write == "storage":
        torch.tensor([], dtype=base.dtype).set_(base.untyped_storage()).fill_(3)
    else:
        with torch.autograd._unsafe_preserve_version_counter(base):
            base.add_(1)
    assert base._version == before
    want = snapshot(sd)
    handle = save(saver, sd, tmp_path / "step-2")
    base.add_(100)  # after the window: must not reach step-2
    handle.wait()
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), want)


def _hold_background(monkeypatch) -> threading.Event:
    """The background waits (before it plans) until the returned event is set."""
    go, plan = threading.Event(), async_module.plan

    def held(*args, **kw):
        assert go.wait(60)
        return plan(*args, **kw)

    monkeypatch.setattr(async_module, "plan", held)
    return go


def _lose_the_parent(tmp_path) -> None:
    shardckpt.rm(tmp_path / "step-1", force=True)
    shardckpt.rm(tmp_path / "step-0", force=True)
    shardckpt.gc(tmp_path)


def test_unreferencable_bytes_are_copied_from_the_caller_when_unchanged(saver, tmp_path, monkeypatch):
    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    save(saver, sd, tmp_path / "step-1").wait()
    _lose_the_parent(tmp_path)  # the window's digests now match no stored row
    want = snapshot(sd)
    go = _hold_background(monkeypatch)
    handle = save(saver, sd, tmp_path / "step-2")
    assert saver.buffers.copied_bytes < sd["base"].nbytes  # hashed in the window, left unstaged
    go.set()
    handle.wait()
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), want)
    assert new_bytes(tmp_path / "step-2") >= sd["base"].nbytes  # written again, from a checked copy


def test_a_change_after_the_window_to_unreferencable_bytes_fails_the_save(saver, tmp_path, monkeypatch):
    """The bytes of the instant are gone and nothing stored holds them: the save commits nothing, says so, and the
    next save copies everything."""
    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    save(saver, sd, tmp_path / "step-1").wait()
    _lose_the_parent(tmp_path)
    go = _hold_background(monkeypatch)
    handle = save(saver, sd, tmp_path / "step-2")
    sd["base"].data[3, 3] = 7.0  # after the window, no bump
    go.set()
    with pytest.raises(CheckpointError, match="'base' changed after async_save returned"):
        handle.wait()
    assert not os.path.exists(tmp_path / "step-2" / "manifest.json")
    monkeypatch.undo()
    want = snapshot(sd)
    save(saver, sd, tmp_path / "step-3").wait()
    assert saver.buffers.copied_bytes >= sd["base"].nbytes  # the digests were forgotten: all staged
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), want)


def test_overwriting_one_step_references_its_own_rows(saver, tmp_path):
    """A "last" checkpoint overwritten at every save: the window compared against that step's rows, so the save
    references them (found by review: it used to skip the step being overwritten, and failed once the caller
    changed a tensor after the call)."""
    sd = state()
    for _ in range(2):
        save(saver, sd, tmp_path / "last", overwrite=True).wait()
    want = snapshot(sd)
    handle = save(saver, sd, tmp_path / "last", overwrite=True)
    sd["base"].add_(1.0)  # an ordinary update after the call returned
    handle.wait()
    assert_bits(shardckpt.load_full(tmp_path / "last"), want)
    assert new_bytes(tmp_path / "last") == 0  # nothing changed at the instant: everything referenced


def test_a_checkpoint_without_a_step_number_does_not_take_the_parent_s_place(saver, tmp_path):
    """``best`` sorts after every step; the window compared against the last save, which stays the parent."""
    sd = state()
    save(saver, sd, tmp_path / "best").wait()
    for step in range(1, 5):
        if step % 2 == 0:
            sd["lora"].add_(1)
        want = snapshot(sd)
        handle = save(saver, sd, tmp_path / f"step-{step}")
        sd["base"].add_(1.0) if step == 3 else None  # bumped after the call: must not fail the save
        handle.wait()
        assert_bits(shardckpt.load_full(tmp_path / f"step-{step}"), want)


def test_the_callers_storage_stays_resizable(saver, tmp_path):
    """The window reads the caller's tensors in place without handing them to numpy, which would pin their
    storage's size (code that frees storage with resize_(0) after a checkpoint)."""
    sd = state()
    for step in range(3):
        save(saver, sd, tmp_path / f"step-{step}").wait()
    sd["base"].untyped_storage().resize_(0)


def test_a_tensor_changing_every_other_save_keeps_its_buffer(saver, tmp_path):
    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    allocations = saver.buffers.allocations
    for step in range(1, 7):
        if step % 2:
            sd["base"].data.add_(1)  # no bump: the window's hash sees it
        save(saver, sd, tmp_path / f"step-{step}").wait()
    assert saver.buffers.allocations == allocations


def test_another_run_or_unit_compares_nothing(saver, tmp_path):
    sd = state()
    save(saver, sd, tmp_path / "a" / "step-0").wait()
    save(saver, sd, tmp_path / "b" / "step-0").wait()
    assert saver.buffers.copied_bytes >= sd["base"].nbytes
    save(saver, sd, tmp_path / "b" / "step-1").wait()
    assert saver.buffers.copied_bytes < sd["base"].nbytes
    saver.save(sd, tmp_path / "b" / "step-2", incremental=True, incremental_unit=2 * UNIT).wait()
    assert saver.buffers.copied_bytes >= sd["base"].nbytes
    want = snapshot(sd)
    for path in ("a/step-0", "b/step-0", "b/step-1", "b/step-2"):
        assert_bits(shardckpt.load_full(tmp_path / path), want)


def test_a_replaced_pool_is_written_from_checked_copies(saver, tmp_path):
    """Another pool has another key: the window's digests cannot be compared with its rows; the bytes are copied,
    checked against the window's digests, and written."""
    import shutil

    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    save(saver, sd, tmp_path / "step-1").wait()
    shutil.rmtree(tmp_path)
    want = snapshot(sd)
    save(saver, sd, tmp_path / "step-2").wait()
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), want)


def test_a_failed_save_forgets_the_digests(saver, tmp_path):
    sd = state()
    save(saver, sd, tmp_path / "step-0").wait()
    save(saver, sd, tmp_path / "step-0").exception()  # exists: fails in the background
    save(saver, sd, tmp_path / "step-1").wait()
    assert saver.buffers.copied_bytes >= sd["base"].nbytes


def _sharded_async(root: str) -> None:
    import torch.distributed as dist

    from shardckpt import ShardedTensor
    from shardckpt.regions import FlatRange

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(60_000, dtype=torch.float32)
    lo, hi = rank * len(full) // world, (rank + 1) * len(full) // world
    local = full[lo:hi].clone()
    sd = {"w": ShardedTensor(local, (len(full),), FlatRange(lo, hi)), "rep": torch.ones(5000), "lora": torch.zeros(9)}
    saver = AsyncSaver()
    staged = []
    try:
        for step in range(3):
            handle = saver.save(sd, os.path.join(root, f"step-{step}"), incremental=True, incremental_unit=16 << 10)
            staged.append(saver.buffers.copied_bytes)
            sd["lora"].add_(1)
            if step == 1:
                local.data[0] = -1.0  # after the window, no bump: step 1 holds the value before; step 2's window sees it
            handle.wait()
    finally:
        saver.close()
    return staged


def test_sharded_and_replicated_pieces_at_ws2(tmp_path):
    staged = run_ranks(2, _sharded_async, str(tmp_path))
    full = torch.arange(60_000, dtype=torch.float32)
    for step in range(3):
        got = shardckpt.load_full(tmp_path / f"step-{step}")
        want = full.clone()
        if step == 2:
            want[0], want[30_000] = -1.0, -1.0
        assert torch.equal(got["w"], want) and torch.equal(got["rep"], torch.ones(5000))
        assert torch.equal(got["lora"], torch.full((9,), float(step)))
    for per_step in staged:
        assert per_step[1] < 30_000 * 4  # step 1: w and rep hashed and left unstaged on both ranks
        assert per_step[2] >= 30_000 * 4  # step 2: w changed without a bump: the hash saw it, w staged


def _piece(t: torch.Tensor, region=None, shape=None):
    from shardckpt.checkpoint.collect import LocalPiece
    from shardckpt.regions import FlatRange

    shape = shape or tuple(t.shape)
    return LocalPiece("t", t, shape, region or FlatRange(0, t.numel()), False)


def _recorded(t: torch.Tensor, key: bytes, cuts: list[tuple[int, int]]):
    from shardckpt.checkpoint.window_hash import Recorded, WindowDigests, version_hint
    from shardckpt.format.content_hash import chunk_hash

    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
    size = t.element_size()
    units = {(a, b): chunk_hash(key, raw[a * size:b * size]) for a, b in cuts}
    return WindowDigests(key, UNIT, "run", "step-1", {"t": Recorded(version_hint(t), units)})


def test_the_window_hashes_only_what_the_last_save_cut_whole_and_did_not_bump():
    from shardckpt.checkpoint.window_hash import WindowHasher
    from shardckpt.regions import Box

    key, t = bytes(range(32)), torch.arange(1000, dtype=torch.float32)
    cuts = [(0, 400), (400, 1000)]
    assert not WindowHasher(None).skip(_piece(t))  # nothing recorded: copied (its hint kept for the next save)
    hasher = WindowHasher(_recorded(t, key, cuts))
    assert hasher.skip(_piece(t)) and hasher.prehashed().digests["t"].keys() == set(cuts)
    assert not WindowHasher(_recorded(t, key, [(0, 400), (500, 1000)])).skip(_piece(t))  # a gap: not this cut
    assert not WindowHasher(_recorded(t, key, [(0, 400)])).skip(_piece(t))  # part of the piece only
    old = _recorded(t, key, cuts)
    t.add_(0)  # bumped, same bytes: copied without hashing
    assert not WindowHasher(old).skip(_piece(t))
    old = _recorded(t, key, cuts)
    t.numpy()[999] = -1  # not bumped, other bytes: the hash sees it
    assert not WindowHasher(old).skip(_piece(t))
    grid = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    column = grid[:, 1:3].contiguous()  # a box of 4 row runs: never left unstaged
    assert not WindowHasher(_recorded(column, key, [(0, 8)])).skip(_piece(column, Box((0, 1), (4, 2)), (4, 5)))
    assert not WindowHasher(_recorded(grid, key, [(0, 20)])).skip(_piece(grid.t()))  # not contiguous


@pytest.mark.parametrize("make", [lambda: torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,)),
                                  lambda: torch.empty(5, device="meta"),
                                  lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])],
                         ids=["sparse", "meta", "nested"])
@pytest.mark.parametrize("how", ["save", "async_save", "async_save incremental"])
def test_a_tensor_without_dense_data_is_refused_by_name(tmp_path, make, how):
    """Found by review: these raised torch's own RuntimeError / NotImplementedError from the copy."""
    from shardckpt.errors import UnsupportedValueError

    sd = {"ok": torch.ones(3), "odd": make()}
    with pytest.raises(UnsupportedValueError, match="'odd'"):
        if how == "save":
            shardckpt.save(sd, tmp_path / "x")
        else:
            shardckpt.async_save(sd, tmp_path / "x", incremental=how.endswith("incremental")).wait()
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_the_default_saver_closed_by_its_user_is_replaced(tmp_path):
    from shardckpt.checkpoint.async_save import saver_for

    shardckpt.async_save({"w": torch.ones(4)}, tmp_path / "a").wait()
    saver_for().close()
    shardckpt.async_save({"w": torch.ones(4)}, tmp_path / "b").wait()  # raised "process group was destroyed"
    assert torch.equal(shardckpt.load_full(tmp_path / "b")["w"], torch.ones(4))
