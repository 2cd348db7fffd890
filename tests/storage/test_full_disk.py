"""A full disk fails a save cleanly (issue 16, item 6): nothing committed, the old checkpoint intact and
loadable, the failed save's files removed. Runs on a small tmpfs (root only; skipped where mounting fails)."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

import shardckpt
from shardckpt.checkpoint.verify import verify
from tests.storage._util import assert_tree_equal


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_full_disk_fails_the_save_and_keeps_the_old_checkpoint(small_disk, compress):
    path = os.path.join(small_disk, "ckpt")
    old = {"w": torch.arange(100_000, dtype=torch.float32), "v": 1}  # 0.4 MiB
    shardckpt.save(old, path)
    committed = sorted(os.listdir(path))
    new = {"w": torch.randn(2_000_000), "v": 2}  # 8 MiB of noise: does not fit, compressed or not
    with pytest.raises(OSError):
        shardckpt.save(new, path, overwrite=True, compress=compress)
    assert sorted(os.listdir(path)) == committed  # the failed generation's files are gone
    assert_tree_equal(shardckpt.load_full(path), old)
    assert verify(path).ok
    shardckpt.save({"w": torch.zeros(10), "v": 3}, path, overwrite=True)  # room again: saves work
    assert shardckpt.load_full(path)["v"] == 3
