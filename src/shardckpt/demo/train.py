"""One rank of the demo's training job: ``python -m shardckpt.demo.train --rank R --world-size W --port P ...``.

It trains ``DemoTransformer`` sharded by ``shardckpt.runtime`` (FULL_SHARD, one unit per block) with AdamW,
checkpoints every ``--save-every`` steps with ``async_save_state`` as LOCAL state (each rank's flat
shards as they are in memory, plus their layouts), and resumes with ``load_state`` from a checkpoint of
any world size and type. Rank 0 appends one JSON line per event to ``--events``; the demo reads them,
as it happens, to know when a save is in flight and to plot the loss.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from shardckpt.demo.model import GLOBAL_BATCH, Block, DemoTransformer, ModelShape, global_batch, loss_of
from shardckpt.dist import collectives
from shardckpt.dist.world import joined
from shardckpt.runtime import shard
from shardckpt.state_dict import StateDictType, async_save_state, get_state_dict, load_state

LEARNING_RATE = 1e-3


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}")


class Events:
    """Rank 0's event log, one JSON object per line, flushed at once (the demo tails it); other ranks: no-op."""

    def __init__(self, path: str, rank: int) -> None:
        self._file = open(path, "a", encoding="utf-8") if rank == 0 else None

    def __call__(self, **event) -> None:
        if self._file:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()


class Saves:
    """The asynchronous saves of one run: one in flight at a time; logs when each started and committed."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.handle = None
        self.step = None
        self.started = 0.0

    def start(self, model, optim, path: str, step: int) -> None:
        waited = self.finish()  # normally long done: a save takes less than save_every steps
        t = time.perf_counter()
        self.handle = async_save_state(model, optim, path, type=StateDictType.LOCAL_STATE_DICT, extra={"step": step})
        self.step, self.started = step, t
        self.events(event="save_started", step=step, blocked_s=time.perf_counter() - t, waited_s=waited)

    def poll(self) -> None:
        if self.handle is not None and self.handle.done():
            self.finish()

    def finish(self) -> float:
        """Wait for the save in flight (raises its error); returns the seconds waited."""
        if self.handle is None:
            return 0.0
        t = time.perf_counter()
        self.handle.wait()
        # Seen at a step boundary (poll) or when waited for: the save took at most this long.
        self.events(event="save_committed", step=self.step, within_s=time.perf_counter() - self.started)
        self.handle = None
        return time.perf_counter() - t


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # every rank builds the same initial weights
    module = DemoTransformer(ModelShape(args.layers, args.dim, args.heads))
    parameters = sum(p.numel() for p in module.parameters())
    model = shard(module, wrap=(Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    first = 0
    if args.resume:
        first = load_state(model, optim, args.resume)["step"]
    events = Events(args.events, args.rank)
    events(event="started", world_size=args.world_size, step=first, resumed_from=args.resume,
           parameters=parameters)
    saves = Saves(events)
    per_rank = GLOBAL_BATCH // args.world_size
    for step in range(first, args.steps):
        seqs = global_batch(step)[args.rank * per_rank:(args.rank + 1) * per_rank]
        optim.zero_grad()
        loss = loss_of(model, seqs)
        loss.backward()
        optim.step()
        mean = loss.detach().clone()
        collectives.all_reduce(mean, collectives.world())
        events(event="loss", step=step, loss=float(mean) / args.world_size)
        saves.poll()
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            saves.start(model, optim, checkpoint_path(args.checkpoints, done), done)
    saves.finish()
    if args.final_weights:
        weights = get_state_dict(model, type=StateDictType.FULL_STATE_DICT)["model"]
        if args.rank == 0:
            torch.save(weights, args.final_weights)
    events(event="finished", step=args.steps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the rendezvous store the demo hosts on 127.0.0.1")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--checkpoints", required=True, help="directory of step-NNNNNN checkpoints")
    p.add_argument("--events", required=True)
    p.add_argument("--resume", help="checkpoint to resume from (any world size and type)")
    p.add_argument("--final-weights", help="torch.save the final FULL model state here (rank 0)")
    p.add_argument("--layers", type=int, default=ModelShape.layers)
    p.add_argument("--dim", type=int, default=ModelShape.dim)
    p.add_argument("--heads", type=int, default=ModelShape.heads)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    with joined(args.rank, args.world_size, args.port):
        train(args)


if __name__ == "__main__":
    main()
