"""``CheckpointManager`` on simulated nodes: pools of gloo ranks, two ranks per node, each node its own tier-0
directory and peer server on 127.0.0.1; saves, replication, uploads and restores at the same and a smaller world
size, a lost node, a corrupt replica."""
from __future__ import annotations

import os
import shutil

import torch

from shardckpt.format.manifest import parse_manifest
from tests._dist import run_ranks
from tests.tiers import _train


def _train_and_save(base: str, steps: int, more: dict | None = None) -> dict:
    import torch.distributed as dist

    from shardckpt.tiers import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    config = _train.config_for(base, rank, **(more or {}))
    w = torch.zeros(_train.ROWS, _train.COLS)
    with CheckpointManager(config) as ckpt:
        for step in range(1, steps + 1):
            w = _train.train_step(w, _train.target())
            handle = ckpt.step(step, _train.state_for(rank, world, w, step))
        ckpt.wait()
        last = (handle.committed.result(), handle.replicated.result(), handle.persisted.result())
        return {"last": last, "status": ckpt.status()}


def _restore(base: str, more: dict | None = None) -> dict:
    import torch.distributed as dist

    from shardckpt.tiers import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    config = _train.config_for(base, rank, **(more or {}))
    state = _train.state_for(rank, world)
    with CheckpointManager(config) as ckpt:
        restored = ckpt.restore(state)
    if restored is None:
        return {"step": None}
    lo, n = _train.rows(rank, world)
    want = _train.full_at(restored.step)[lo:lo + n]
    return {"step": restored.step, "state_step": state["step"], "equal": torch.equal(state["w"].local, want),
            "tiers": restored.tiers, "slowest": restored.slowest_tier, "excluded": len(restored.excluded),
            "epoch": restored.epoch}


def test_save_replicate_upload_then_restore_from_tier0(tmp_path):
    base = str(tmp_path)
    out = run_ranks(4, _train_and_save, base, 4, {"persistent_every": 2}, timeout=180)
    assert out[0]["last"] == (True, True, True)
    assert out[0]["status"]["steps"] == [3, 4]  # keep_last=2
    for node in ("node-0", "node-1"):  # each node: its own files and its peer's replicas
        step_dir = os.path.join(base, node, "run", "step-000000004")
        manifest = parse_manifest(open(os.path.join(step_dir, "manifest.json"), "rb").read(), step_dir)
        assert all(os.path.exists(os.path.join(step_dir, f.path)) for f in manifest.files)
    assert os.path.exists(os.path.join(base, "persistent", "step-000000004", "manifest.json"))
    got = run_ranks(4, _restore, base, timeout=180)
    assert all(g["step"] == 4 and g["state_step"] == 4 and g["equal"] for g in got), got
    assert all(g["tiers"] == {"tier0": g["tiers"]["tier0"]} and g["slowest"] == "tier0" for g in got), got  # nothing lost


def test_node_lost_restores_from_replicas_same_and_smaller_world(tmp_path):
    base = str(tmp_path)
    run_ranks(4, _train_and_save, base, 3, {"persistent_every": 2}, timeout=180)
    shutil.rmtree(os.path.join(base, "node-1"))  # node 1 is lost
    backup = str(tmp_path / "backup")
    shutil.copytree(os.path.join(base, "node-0"), backup)
    got = run_ranks(4, _restore, base, timeout=180)  # a replacement node 1, empty
    assert all(g["step"] == 3 and g["equal"] for g in got), got
    assert got[0]["tiers"].get("tier2", 0) == 0 and got[0]["tiers"]["tier1"] > 0
    shutil.rmtree(os.path.join(base, "node-0"))
    shutil.copytree(backup, os.path.join(base, "node-0"))
    shutil.rmtree(os.path.join(base, "node-1"))
    got = run_ranks(2, _restore, base, timeout=180)  # node 0 alone, resharded 4 -> 2
    assert all(g["step"] == 3 and g["equal"] for g in got), got


def test_corrupt_replica_is_excluded_never_loaded(tmp_path):
    base = str(tmp_path)
    run_ranks(4, _train_and_save, base, 4, {"persistent_every": 2}, timeout=180)
    shutil.rmtree(os.path.join(base, "node-1"))
    step_dir = os.path.join(base, "node-0", "run", "step-000000004")
    manifest = parse_manifest(open(os.path.join(step_dir, "manifest.json"), "rb").read(), step_dir)
    replica = next(f for f in manifest.files if "rank-00002" in f.path)  # node 1's file, held by node 0
    with open(os.path.join(step_dir, replica.path), "r+b") as f:
        f.seek(replica.size // 2)
        byte = f.read(1)
        f.seek(replica.size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    got = run_ranks(2, _restore, base, timeout=180)
    # step 4 still has a good copy of that file in tier 2: restored from there, the flipped copy excluded
    assert all(g["step"] == 4 and g["equal"] and g["excluded"] >= 1 for g in got), got
    assert got[0]["tiers"].get("tier2", 0) > 0


def _open_with_busy_leader_port(base: str, port: int) -> str:
    from shardckpt.tiers import CheckpointManager, TierConfigError
    import torch.distributed as dist

    rank = dist.get_rank()
    try:  # node 0's leader (rank 0) cannot serve on the busy port; rank 1 must not wait for it forever
        CheckpointManager(_train.config_for(base, rank, peer_port=port if rank == 0 else 0))
    except TierConfigError as e:
        return str(e)
    return "opened"


def test_a_leader_that_cannot_serve_fails_every_rank(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        got = run_ranks(2, _open_with_busy_leader_port, str(tmp_path), port, timeout=60)
    assert all(f"127.0.0.1:{port}" in g for g in got), got


def _one_rank_raises(base: str) -> str:
    import torch.distributed as dist

    from shardckpt.tiers import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    config = _train.config_for(base, rank, keep_local_on_close=False, persistent_dir=None)
    try:
        with CheckpointManager(config) as ckpt:
            ckpt.save(1, _train.state_for(rank, world, torch.zeros(_train.ROWS, _train.COLS), 1))
            ckpt.wait()
            if rank == 1:  # not the node's leader, which alone removes tier 0 and leaves normally
                raise RuntimeError("evaluation failed on rank 1")
    except RuntimeError as e:
        return str(e)
    return "ok"


def test_one_rank_leaving_by_an_exception_keeps_its_nodes_tier_0(tmp_path):
    # helper-23: the keep was decided per rank, so the leader's normal exit removed the node's only copy
    base = str(tmp_path)
    assert run_ranks(2, _one_rank_raises, base, timeout=180) == ["ok", "evaluation failed on rank 1"]
    assert os.path.exists(os.path.join(base, "node-0", "run", "step-000000001", "manifest.json"))


def _restore_mid_run_then_save(base: str) -> dict:
    import glob

    import torch.distributed as dist

    from shardckpt.tiers import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    config = _train.config_for(base, 2 * rank, persistent_dir=None, keep_last=5)  # one rank per node
    w = torch.zeros(_train.ROWS, _train.COLS)
    with CheckpointManager(config) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _train.state_for(rank, world, w + step, step))
        ckpt.wait()
        dist.barrier()
        if rank == 0:  # every copy of steps 3 and 4 corrupt: the restore falls back to step 2
            for path in glob.glob(os.path.join(base, "node-*", "run", "step-00000000[34]", "*", "*.bin")):
                if not os.path.getsize(path):
                    continue
                with open(path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last[0] ^ 0xFF]))
        dist.barrier()
        restored = ckpt.restore(_train.state_for(rank, world, w, 0)).step
        handle = ckpt.save(3, _train.state_for(rank, world, w + 30, 3))  # the new timeline's step 3
        ckpt.wait()
        return {"restored": restored, "replicated": handle.replicated.result(), "safe": ckpt.status()["safe"]}


def test_a_restore_mid_run_resets_which_step_is_newest(tmp_path):
    # helper-24: after a restore that fell back, the abandoned step 4 stayed the newest, so the new step 3 was never
    # replicated (and counted as safe); after a node loss an older step was restored
    base = str(tmp_path)
    got = run_ranks(2, _restore_mid_run_then_save, base, timeout=180)
    assert all(g["restored"] == 2 and g["replicated"] is True and 4 not in g["safe"] for g in got), got
    shutil.rmtree(os.path.join(base, "node-1"))  # node 1 lost
    again = run_ranks(2, _restore_one_rank_per_node, base, timeout=180)
    assert again == [(3, True), (3, True)], again


def _restore_one_rank_per_node(base: str) -> tuple:
    import torch.distributed as dist

    from shardckpt.tiers import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    state = _train.state_for(rank, world)
    with CheckpointManager(_train.config_for(base, 2 * rank, persistent_dir=None, keep_last=5)) as ckpt:
        restored = ckpt.restore(state)
    lo, n = _train.rows(rank, world)
    return restored.step, torch.equal(state["w"].local, torch.full((n, _train.COLS), 30.0))


def _restore_with_a_failing_recheck(base: str) -> str:
    import torch.distributed as dist

    from shardckpt.errors import StorageError
    from shardckpt.tiers import CheckpointManager, restore_io

    rank = dist.get_rank()
    if rank == 1:  # a store whose retries are spent while the copies are checked again
        def failing(*args, **kwargs):
            raise StorageError("injected: kept failing")
        restore_io.check_file = failing
    with CheckpointManager(_train.config_for(base, rank, persistent_dir=None)) as ckpt:
        try:
            ckpt.restore(_train.state_for(rank, dist.get_world_size()))
        except StorageError as e:
            return f"StorageError: {e}"
    return "restored"


def test_a_recheck_that_cannot_read_raises_on_every_rank(tmp_path):
    # helper-29: the re-check after a failed load ran outside attempt(); rank 1 left the restore with the error and
    # rank 0's next all_gather paired with rank 1's close: TypeError (or a hang)
    base = str(tmp_path)
    run_ranks(2, _train_and_save, base, 2, {"persistent_dir": None}, timeout=180)
    step_dir = os.path.join(base, "node-0", "run", "step-000000002")
    manifest = parse_manifest(open(os.path.join(step_dir, "manifest.json"), "rb").read(), step_dir)
    data = next(f for f in manifest.files if "rank-00001" in f.path and f.size)
    with open(os.path.join(step_dir, data.path), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))
    got = run_ranks(2, _restore_with_a_failing_recheck, base, timeout=180)
    assert all(g.startswith("StorageError") and "kept failing" in g for g in got), got
