"""A training job with tiers, run as real processes by tests/tiers/test_kill.py (one process per rank, two ranks
per simulated node): restore, then train ``_train``'s state and save every step, logging the loss.

    RANK=r WORLD_SIZE=n MASTER_PORT=p python tests/tiers/_node_job.py BASE STEPS SLEEP PERSISTENT_EVERY

Writes ``BASE/restored-<rank>.json`` (the step restored, whether the state equals the uninterrupted run's at that
step bit for bit, bytes by tier, copies excluded) and appends rank 0's ``{"step", "loss", "world"}`` lines to
``BASE/losses.jsonl``. ``SHARDCKPT_TIERS_KILL`` (``lanes._test_hook``) makes a rank kill itself mid-lane."""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardckpt.tiers import CheckpointManager  # noqa: E402
from tests.tiers import _train  # noqa: E402


def main(base: str, steps: int, sleep_s: float, persistent_every: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _train.config_for(base, rank, persistent_every=persistent_every)
    state = _train.state_for(rank, world)
    lo, n = _train.rows(rank, world)
    goal = _train.target()[lo:lo + n]
    with CheckpointManager(config) as ckpt:
        restored = ckpt.restore(state)
        start = restored.step if restored else 0
        if restored is not None:
            equal = torch.equal(state["w"].local, _train.full_at(start)[lo:lo + n]) and state["step"] == start
            with open(os.path.join(base, f"restored-{rank}.json"), "w") as f:
                json.dump({"step": start, "equal": equal, "tiers": restored.tiers, "excluded": len(restored.excluded),
                           "slowest": restored.slowest_tier, "world": world}, f)
        for step in range(start + 1, steps + 1):
            state["w"].local.copy_(_train.train_step(state["w"].local, goal))
            state["step"] = step
            loss = torch.tensor([float(((state["w"].local - goal) ** 2).sum())], dtype=torch.float64)
            dist.all_reduce(loss)
            if rank == 0:
                with open(os.path.join(base, "losses.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss.item(), "world": world}) + "\n")
            ckpt.step(step, state)
            time.sleep(sleep_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
