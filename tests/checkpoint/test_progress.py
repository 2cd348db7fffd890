"""Progress callbacks of save, load and load_full: ``progress(done_bytes, total_bytes)`` with this rank's tensor
bytes, monotonic, ending at ``(total, total)``; a callback that raises fails the operation (a save: nothing
committed)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt.checkpoint import progress as progress_module
from shardckpt.format.manifest import MANIFEST_NAME
from tests._dist import run_ranks
from tests.checkpoint.cases import empty_like_state, reference, sharded_state


class Calls:
    """Records the calls (the writer threads call from several threads)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.calls.append((done, total))

    def check(self, total: int) -> None:
        assert self.calls, "progress was never called"
        assert {t for _, t in self.calls} == {total}
        dones = [d for d, _ in self.calls]
        assert dones == sorted(dones) and dones[0] >= 0
        assert self.calls[-1] == (total, total)


def _state() -> dict:
    return {"model": {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100),
                      "b": torch.ones(7, dtype=torch.bfloat16),
                      "scalar": torch.tensor(3.5, dtype=torch.float64),
                      "empty": torch.empty(0, 4)},
            "step": 5}


def _bytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd["model"].values())


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_save_load_and_load_full_report_the_tensor_bytes(tmp_path, compress):
    sd, path, total = _state(), tmp_path / "ckpt", _bytes(_state())
    saved = Calls()
    shardckpt.save(sd, path, progress=saved, compress=compress)
    saved.check(total)

    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    loaded = Calls()
    shardckpt.load(target, path, progress=loaded)
    loaded.check(total)
    assert all(target["model"][k].equal(v) for k, v in sd["model"].items())

    full = Calls()
    out = shardckpt.load_full(path, progress=full)
    full.check(total)
    assert out["model"]["w"].equal(sd["model"]["w"])
    only = Calls()
    shardckpt.load_full(path, keys=["model.b"], progress=only)
    only.check(7 * 2)


def test_large_reads_report_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_module, "READ_BATCH_BYTES", 1000)
    sd = {f"t{i}": torch.full((100,), float(i)) for i in range(10)}  # 400 bytes each
    shardckpt.save(sd, tmp_path / "ckpt")
    calls = Calls()
    out = shardckpt.load_full(tmp_path / "ckpt", progress=calls)
    calls.check(4000)
    assert calls.calls == [(0, 4000), (1200, 4000), (2400, 4000), (3600, 4000), (4000, 4000)]
    assert all(out[k].equal(v) for k, v in sd.items())


def test_a_raising_callback_fails_the_save_and_commits_nothing(tmp_path):
    path = tmp_path / "ckpt"
    shardckpt.save(_state(), path)
    before = (path / MANIFEST_NAME).read_bytes()

    def stop(done: int, total: int) -> None:
        if done:  # mid-save: some bytes are written
            raise ValueError("stop")

    changed = {"model": {k: v + 1 for k, v in _state()["model"].items()}, "step": 6}
    with pytest.raises(ValueError, match="stop"):
        shardckpt.save(changed, path, overwrite=True, progress=stop)
    assert (path / MANIFEST_NAME).read_bytes() == before
    assert len(list(path.glob("data-*"))) == 1  # the failed generation's files are gone
    out = shardckpt.load_full(path)
    assert out["step"] == 5 and out["model"]["w"].equal(_state()["model"]["w"])

    def fail(done: int, total: int) -> None:
        raise ValueError("no progress today")

    with pytest.raises(ValueError, match="no progress today"):
        shardckpt.save(changed, tmp_path / "new", progress=fail)
    assert not (tmp_path / "new" / MANIFEST_NAME).exists()


def test_a_raising_callback_fails_the_load(tmp_path):
    shardckpt.save(_state(), tmp_path / "ckpt")

    def fail(done: int, total: int) -> None:
        raise ValueError("no progress today")

    with pytest.raises(ValueError, match="no progress today"):
        shardckpt.load_full(tmp_path / "ckpt", progress=fail)


def _save_and_load_with_progress(path: str) -> tuple[list, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    saved, loaded = Calls(), Calls()
    shardckpt.save(sharded_state(rank, world, 0), path, progress=saved)
    target = empty_like_state(rank, world, 0)
    shardckpt.load(target, path, progress=loaded)
    return saved.calls, loaded.calls


def test_two_ranks_each_report_their_own_bytes(tmp_path):
    results = run_ranks(2, _save_and_load_with_progress, str(tmp_path / "ckpt"))
    for saved, loaded in results:
        for calls in (saved, loaded):
            checker = Calls()
            checker.calls = calls
            checker.check(calls[-1][1])
    # every tensor is stored once, by one rank: the ranks' save totals add up to the tensors' bytes
    assert sum(saved[-1][1] for saved, _ in results) == sum(
        v.numel() * v.element_size() for v in reference()["model"].values())
    assert all(loaded[-1][1] > 0 for _, loaded in results)


def test_async_save_reports_from_the_background(tmp_path):
    calls = Calls()
    shardckpt.async_save(_state(), str(tmp_path / "ckpt"), progress=calls).wait()
    calls.check(_bytes(_state()))
