"""A tiny deterministic training state for the tiers tests: ``w`` (64 x 16, fp32) sharded by rows over the ranks,
trained elementwise towards a fixed target, so that every step's values are the same at any world size and a
restored state can be compared bit for bit with the uninterrupted run's."""
from __future__ import annotations

import os

import torch

from shardckpt.regions import Box
from shardckpt.sharded_tensor import ShardedTensor
from shardckpt.tiers import TierConfig

ROWS, COLS = 64, 16
LR = 0.05


def target() -> torch.Tensor:
    return torch.linspace(-1, 1, ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def full_at(step: int) -> torch.Tensor:
    """The whole of ``w`` after ``step`` training steps of the uninterrupted run."""
    w = torch.zeros(ROWS, COLS)
    for _ in range(step):
        w = train_step(w, target())
    return w


def train_step(w: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    return w - LR * 2 * (w - goal)


def loss_of(full: torch.Tensor) -> float:
    return float(((full - target()) ** 2).sum())


def rows(rank: int, world: int) -> tuple[int, int]:
    per = ROWS // world
    return rank * per, per


def state_for(rank: int, world: int, w_full: torch.Tensor | None = None, step: int = 0) -> dict:
    lo, n = rows(rank, world)
    local = (w_full[lo:lo + n].clone() if w_full is not None else torch.zeros(n, COLS))
    return {"w": ShardedTensor(local, (ROWS, COLS), Box((lo, 0), (n, COLS))), "step": step}


def config_for(base: str, rank: int, **more) -> TierConfig:
    node = f"node-{rank // 2}"
    kw = dict(local_dir=os.path.join(base, node), run_id="run", persistent_dir=os.path.join(base, "persistent"),
              node_id=node, peer_host="127.0.0.1", keep_local_on_close=True, min_free=1, peer_timeout_s=20.0)
    kw.update(more)
    return TierConfig(**kw)
