"""What an adversarial review of ``CheckpointManager`` found (one process, a world of one): a save in flight
when the program exits without ``close``, steps that cannot name a directory or repeat one, a peer port in use,
and the peer address a node advertises."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt.errors import BadArgumentError
from shardckpt.tiers import CheckpointManager, TierConfig, TierConfigError
from shardckpt.tiers.peer import default_peer_host


def _config(tmp_path, **more) -> TierConfig:
    kw = dict(local_dir=str(tmp_path / "t0"), run_id="r", node_id="n", min_free=1, peer_host="127.0.0.1",
              keep_local_on_close=True)
    kw.update(more)
    return TierConfig(**kw)


def test_a_save_in_flight_at_exit_reaches_tier_0_and_tier_2(tmp_path):
    code = ("import torch, sys\nfrom shardckpt.tiers import CheckpointManager, TierConfig\n"
            f"c = TierConfig(local_dir={str(tmp_path / 't0')!r}, run_id='r', node_id='n', min_free=1, "
            f"peer_host='127.0.0.1', persistent_dir={str(tmp_path / 't2')!r}, persistent_every=1, "
            "keep_local_on_close=True)\n"
            "m = CheckpointManager(c)\nm.save(1, {'w': torch.arange(1 << 20, dtype=torch.float32)})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for where in (tmp_path / "t0" / "r", tmp_path / "t2"):
        step = where / "step-000000001"
        assert (step / "manifest.json").exists(), (where, os.listdir(where))
        assert torch.equal(shardckpt.load_full(str(step))["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("step", [-1, 10 ** 9, 2.0, "3", True])
def test_a_step_that_names_no_directory_is_refused(tmp_path, step):
    with CheckpointManager(_config(tmp_path)) as ckpt:
        for call in (ckpt.save, ckpt.step):
            with pytest.raises(BadArgumentError, match="must be an int in 0..999999999"):
                call(step, {"w": torch.zeros(4)})
        assert ckpt.status()["steps"] == []


def test_steps_must_increase(tmp_path):
    with CheckpointManager(_config(tmp_path, persistent_dir=str(tmp_path / "t2"), persistent_every=2)) as ckpt:
        ckpt.save(4, {"w": torch.zeros(4)})
        for step in (4, 3):
            with pytest.raises(BadArgumentError, match="not after step 4"):
                ckpt.save(step, {"w": torch.ones(4)})
        with pytest.raises(ZeroDivisionError):
            ckpt.save(6, lambda: {"w": torch.ones(4) / 0 if 1 / 0 else None})  # not saved: step 6 is not taken
        ckpt.save(6, {"w": torch.ones(4)})
    state = {"w": torch.full((4,), 9.0)}
    with CheckpointManager(_config(tmp_path)) as ckpt:
        assert ckpt.restore(state).step == 6 and torch.equal(state["w"], torch.ones(4))
        with pytest.raises(BadArgumentError, match="not after step 6"):  # the restored step too
            ckpt.save(6, state)


def test_a_peer_port_in_use_is_a_config_error_naming_it(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(TierConfigError, match=f"peer_host/peer_port: cannot serve .* on 127.0.0.1:{port}"):
            CheckpointManager(_config(tmp_path, peer_port=port))


def test_the_default_peer_host_is_the_interface_towards_the_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert default_peer_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: routed (if at all) through a real interface
    host = default_peer_host()
    assert host == "127.0.0.1" or not host.startswith("127."), host  # never loopback for a remote rendezvous


def test_a_restored_step_missing_from_tier_2_is_uploaded_again(tmp_path):
    config = _config(tmp_path, persistent_dir=str(tmp_path / "t2"), persistent_every=2)
    with CheckpointManager(config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + step})
    step2 = tmp_path / "t2" / "step-000000002"
    os.remove(step2 / "manifest.json")  # as a kill during the upload leaves it: files, no commit
    state = {"w": torch.zeros(4096)}
    with CheckpointManager(config) as ckpt:
        restored = ckpt.restore(state)
        assert restored.step == 2 and restored.slowest_tier == "tier0"
        ckpt.wait()
        assert (step2 / "manifest.json").exists()
    assert torch.equal(shardckpt.load_full(str(step2))["w"], torch.arange(4096, dtype=torch.float32) + 2)
    assert shardckpt.verify(str(step2)).ok


def test_tier_2_on_an_s3_store_opened_with_persistent_options(tmp_path, s3_bucket):
    server, bucket = s3_bucket
    config = _config(tmp_path, persistent_dir=f"s3://{bucket}/run", persistent_every=2,
                     persistent_options=server.options())
    with CheckpointManager(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + step})
    got = shardckpt.load_full(f"s3://{bucket}/run/step-000000002", storage_options=server.options())
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32) + 2)
    state = {"w": torch.zeros(4096)}
    with CheckpointManager(config.replace(run_id="elsewhere")) as ckpt:  # no tier 0: tier 2's newest
        restored = ckpt.restore(state)
    assert restored.step == 2 and restored.slowest_tier == "tier2"
    assert torch.equal(state["w"], torch.arange(4096, dtype=torch.float32) + 2)


@pytest.mark.parametrize("more, message", [
    (dict(persistent_options={"endpoint_url": "http://127.0.0.1:1"}), "without a persistent_dir"),
    (dict(persistent_dir="s3://b/x", persistent_options="endpoint=x"), "expected a StorageOptions or a dict"),
])
def test_persistent_options_that_cannot_be_used_are_refused(tmp_path, more, message):
    with pytest.raises(TierConfigError, match=message):
        _config(tmp_path, **more)


def test_tier_2_retention_keeps_the_current_timeline_after_a_fallback(tmp_path):
    import glob
    import shutil

    config = _config(tmp_path, keep_last=4, persistent_dir=str(tmp_path / "t2"), persistent_every=2,
                     persistent_keep_last=1)
    with CheckpointManager(config) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + step})
    data = max(glob.glob(str(tmp_path / "t2" / "step-000000008" / "data-*" / "*.bin")), key=os.path.getsize)
    with open(data, "r+b") as f:  # tier 2's step 8 corrupt, tier 0's 6..8 gone: the restore falls back to 5
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    for step in (6, 7, 8):
        shutil.rmtree(tmp_path / "t0" / "r" / f"step-00000000{step}")
    with CheckpointManager(config) as ckpt:
        assert ckpt.restore({"w": torch.zeros(4096)}).step == 5
        ckpt.save(6, {"w": torch.arange(4096, dtype=torch.float32) + 6})  # epoch 1: newer than epoch 0's step 8
    assert [n for n in os.listdir(tmp_path / "t2") if (tmp_path / "t2" / n / "manifest.json").exists()] == \
        ["step-000000006"]
    shutil.rmtree(tmp_path / "t0")
    state = {"w": torch.zeros(4096)}
    with CheckpointManager(config) as ckpt:
        assert ckpt.restore(state).step == 6 and torch.equal(state["w"], torch.arange(4096, dtype=torch.float32) + 6)


@pytest.mark.parametrize("through", ["upload", "direct"])
def test_a_step_number_saved_again_after_a_fallback_past_it_leaves_tier_2s_copy_and_goes_on(tmp_path, through,
                                                                                            caplog):
    # the fresh-clone CI run: a restore fell back past tier 2's corrupt step 8; the run's own new step 8 then failed
    # its upload (CheckpointExistsError) and the job failed at its next call. A first fix deleted such steps at the
    # restore, which also deleted good ones (another run's, a passing read error's verdict: helper-31): now the
    # restore's verdict only lets the upload give way, with a warning, and nothing is deleted
    import glob
    import logging

    config = _config(tmp_path, keep_last=4, persistent_dir=str(tmp_path / "t2"), persistent_every=2)
    with CheckpointManager(config) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + step})
    old = glob.glob(str(tmp_path / "t2" / "step-000000008" / "data-*"))
    data = max(glob.glob(old[0] + "/*.bin"), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    manifest = (tmp_path / "t2" / "step-000000008" / "manifest.json").read_bytes()
    shutil.rmtree(tmp_path / "t0" / "r" / "step-000000008")
    if through == "direct":  # no room in tier 0: a due step is written to tier 2 from the staging buffers
        config = config.replace(local_budget=1000)
    with caplog.at_level(logging.WARNING, logger="shardckpt.tiers"), CheckpointManager(config) as ckpt:
        assert ckpt.restore({"w": torch.zeros(4096)}).step == 7
        saves = [ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + 100 + step}) for step in (8, 9)]
        ckpt.wait()
        assert saves[0].persisted.result() is False
    assert "the last restore found incomplete or corrupt" in caplog.text
    assert (tmp_path / "t2" / "step-000000008" / "manifest.json").read_bytes() == manifest and os.path.exists(old[0])
    if through == "upload":  # the run's own step 8 (epoch 1) is in tier 0, and a restore prefers it
        state = {"w": torch.zeros(4096)}
        with CheckpointManager(config) as ckpt:
            restored = ckpt.restore(state)
        assert (restored.step, restored.epoch) == (9, 1)
        assert torch.equal(state["w"], torch.arange(4096, dtype=torch.float32) + 109)


def test_a_run_started_again_without_restore_keeps_tier_2s_checkpoints(tmp_path):
    # helper-29 on the first form of the fix above (replacing any earlier epoch's step): a job restarted without
    # restore() replaced the old run's tier-2 steps, its newest good one included
    from shardckpt.errors import CheckpointExistsError

    config = _config(tmp_path, persistent_dir=str(tmp_path / "t2"), persistent_every=2)
    with CheckpointManager(config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.arange(4096, dtype=torch.float32) + step})
    with pytest.raises(CheckpointExistsError, match="without restore"):
        with CheckpointManager(config) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, {"w": torch.zeros(4096)})
    assert torch.equal(shardckpt.load_full(str(tmp_path / "t2" / "step-000000002"))["w"],
                       torch.arange(4096, dtype=torch.float32) + 2)
