"""The training half of ``shardckpt demo``: train sharded on 2 ranks, checkpoint, resume on 3 ranks.

A small decoder-style model (tied embedding and head) is sharded with ``shardckpt.runtime``, trained
with AdamW, saved as a LOCAL checkpoint (the flat shards as they are in memory, plus their layouts),
and resumed at another world size by ``load_state``, which reads each rank's new shards straight from
the files. The resumed losses are compared with an uninterrupted run.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from shardckpt.dist import collectives
from shardckpt.runtime import shard
from shardckpt.state_dict import StateDictType, load_state, save_state

VOCAB, DIM, SEQ, BATCH = 97, 48, 16, 12  # BATCH divides by 1, 2, 3 and 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=DIM ** -0.5)  # tied: moderate first logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _batches(first: int, last: int) -> list[torch.Tensor]:
    """Global batches ``first .. last-1`` of a fixed synthetic sequence task (next token = (token * 7) % VOCAB)."""
    out = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        out.append((start * torch.tensor(7) ** torch.arange(SEQ + 1)) % VOCAB)
    return out


def train_job(rank: int, world: int, first: int, last: int, resume: str | None, save_to: str | None,
              report: str) -> None:
    """Train steps ``first .. last-1`` (resuming from ``resume`` if given); rank 0 writes the losses to ``report``."""
    torch.manual_seed(0)
    model = shard(TinyLM(), wrap=(Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if resume:
        extra = load_state(model, optim, resume)
        assert extra["step"] == first, extra
    losses = []
    per = BATCH // world
    for seq in _batches(first, last):
        ids = seq[rank * per:(rank + 1) * per]
        optim.zero_grad()
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        mean = loss.detach().clone()
        collectives.all_reduce(mean, collectives.world())
        losses.append(float(mean) / world)
    if save_to:
        save_state(model, optim, save_to, type=StateDictType.LOCAL_STATE_DICT, extra={"step": last})
    if rank == 0:
        with open(report, "w") as f:
            json.dump(losses, f)


def read_losses(path: str) -> list[float]:
    with open(path) as f:
        return json.load(f)


def report_path(root: str, tag: str) -> str:
    return os.path.join(root, f"losses-{tag}.json")
