"""A killed ``convert`` resumes: rerun with the same source and options, it keeps the output ranks the killed run
had finished and writes the rest; the result is the one an uninterrupted run commits. Nothing partial loads."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
import shardckpt.convert.convert as convert_module
from shardckpt import CheckpointNotFoundError
from shardckpt.checkpoint.verify import verify
from shardckpt.convert.convert import convert
from shardckpt.convert.diff import diff
from shardckpt.formats.native import read_manifest
from shardckpt.io import LocalStorage, open_storage
from tests.convert._kill import killed_after


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(12, 5, generator=g) for i in range(4)} |
            {"bias": torch.randn(3, generator=g), "scale": torch.tensor(2.0)},
            "optim": {"state": {"bias": {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["bias"]}]},
            "step": 7}


def _killed_after(ranks: int, src, dst, **options) -> None:
    """convert killed (kill -9 style) as it starts output rank ``ranks + 1``."""
    killed_after(ranks, convert_module, "write_rank_files", lambda: convert(src, dst, **options))


def _manifest(path):
    return read_manifest(open_storage(path))


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_killed_convert_keeps_its_finished_ranks_and_commits_what_an_uninterrupted_run_does(tmp_path, compress):
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    shardckpt.save(_state(), src)
    options = {"world_size": 4, "compress": compress}
    _killed_after(2, src, dst, **options)
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.load_full(dst)  # nothing partial loads
    report = convert(src, dst, **options)
    assert report.kept_ranks == (0, 1)
    convert(src, fresh, **options)
    got, want = _manifest(dst), _manifest(fresh)
    assert {n: t.crc32c for n, t in got.tensors.items()} == {n: t.crc32c for n, t in want.tensors.items()}
    assert verify(dst).ok and diff(src, dst).equal
    assert sorted(os.listdir(dst)) == ["data-" + got.generation, "manifest.json"]


def test_a_damaged_rank_of_the_killed_run_is_written_again(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    _killed_after(2, src, dst, world_size=4)
    data = next(os.path.join(dst, d) for d in os.listdir(dst) if d.startswith("data-"))
    index = os.path.join(data, "rank-00001-0.index.json")
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) // 2)  # as if the kill had come while the index was written
    report = convert(src, dst, world_size=4)
    assert report.kept_ranks == (0,)
    assert verify(dst).ok and diff(src, dst).equal


def test_other_options_or_a_source_saved_again_start_over(tmp_path):
    src, dst, dst2 = tmp_path / "src", tmp_path / "dst", tmp_path / "dst2"
    shardckpt.save(_state(), src)
    _killed_after(2, src, dst, world_size=4)
    report = convert(src, dst, world_size=4, dtype=torch.bfloat16)  # another output at the same place
    assert report.kept_ranks == () and verify(dst).ok
    assert sorted(os.listdir(dst)) == ["data-" + _manifest(dst).generation, "manifest.json"]  # the debris gone
    _killed_after(2, src, dst2, world_size=4)
    shardckpt.save(_state(seed=1), src, overwrite=True)  # the same path, new values: a new identity
    report = convert(src, dst2, world_size=4)
    assert report.kept_ranks == () and diff(src, dst2).equal
    again = convert(src, dst2, world_size=4, overwrite=True)  # the same conversion once more, over its own commit
    assert again.kept_ranks == () and verify(dst2).ok and diff(src, dst2).equal


def test_a_second_run_of_the_same_conversion_while_one_is_writing_fails_at_once(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    real, second = convert_module.write_rank_files, []

    def with_a_second_run(*args):
        if not second:  # while the first run writes its first rank, the same command starts again
            second.append(1)
            with pytest.raises(shardckpt.CheckpointError, match="another live process is writing"):
                convert(src, dst, world_size=4)
        return real(*args)

    monkeypatch.setattr(convert_module, "write_rank_files", with_a_second_run)
    convert(src, dst, world_size=4)
    assert second and verify(dst).ok and diff(src, dst).equal


def test_the_loser_of_two_identical_conversions_keeps_the_winners_files(tmp_path, monkeypatch):
    """Without locks (object stores), two runs of one conversion write the same files; the one that loses the
    commit must not remove the data directory the winner's manifest names."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    real_hold = LocalStorage.hold_dir
    monkeypatch.setattr(LocalStorage, "hold_dir", lambda self, path, exclusive=False: real_hold(self, path))
    real, second = convert_module.write_rank_files, []

    def with_a_second_run(*args):
        if not second:  # the same command, run to its commit while the first one writes
            second.append(1)
            convert(src, dst, world_size=4)
        return real(*args)

    monkeypatch.setattr(convert_module, "write_rank_files", with_a_second_run)
    with pytest.raises(shardckpt.CheckpointExistsError):
        convert(src, dst, world_size=4)
    assert second and verify(dst).ok and diff(src, dst).equal
