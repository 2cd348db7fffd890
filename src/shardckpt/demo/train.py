"""One rank of the demo's training job: ``python -m shardckpt.demo.train --rank R --world-size W --port P ...``.

It trains ``DemoTransformer`` sharded by ``shardckpt.runtime`` (FULL_SHARD, one unit per block) with AdamW,
checkpoints every ``--save-every`` steps with ``async_save_state`` as LOCAL state (each rank's flat
shards as they are in memory, plus their layouts), and resumes with ``load_state`` from a checkpoint of
any world size and type. Rank 0 appends one JSON line per event to ``--events``; the demo reads them,
as it happens, to know when a save is in flight and to plot the loss.

With ``--tiers DIR`` (``shardckpt demo --tiers``) it checkpoints through ``shardckpt.tiers.CheckpointManager``
instead: SHARDED state every ``--save-every`` steps into its node's tier 0 (``DIR/nodes/node-N``, ``N`` = rank //
``--ranks-per-node``), replicated to the other node, and every ``--persistent-every`` steps uploaded to tier 2
(``DIR/persistent``); it starts by restoring the newest complete step found across the tiers.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import threading
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
        self._lock = threading.Lock()  # the tiers report from their background threads

    def __call__(self, **event) -> None:
        if self._file:
            with self._lock:
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


class TierSaves:
    """The saves of a run with tiers (``--tiers``): each returns once staged; rank 0 logs each tier as it lands."""

    def __init__(self, manager, events: Events) -> None:
        self.manager, self.events = manager, events

    def start(self, model, optim, path: str, step: int) -> None:
        t = time.perf_counter()
        handle = self.manager.save(step, lambda: {**get_state_dict(model, optim, type=StateDictType.SHARDED_STATE_DICT),
                                                  "step": step})
        self.events(event="save_started", step=step, blocked_s=time.perf_counter() - t, waited_s=0.0)
        for tier, future in (("tier0", handle.committed), ("tier1", handle.replicated), ("tier2", handle.persisted)):
            future.add_done_callback(functools.partial(self._landed, step, tier))

    def _landed(self, step: int, tier: str, future) -> None:
        if future.exception() is None and future.result():
            self.events(event="tier_saved", step=step, tier=tier)

    def poll(self) -> None:
        pass

    def finish(self) -> float:
        t = time.perf_counter()
        self.manager.wait()
        return time.perf_counter() - t


def tier_config(args: argparse.Namespace):
    from shardckpt.tiers import TierConfig

    node = f"node-{args.rank // args.ranks_per_node}"
    return TierConfig(local_dir=os.path.join(args.tiers, "nodes", node), run_id="demo", node_id=node,
                      persistent_dir=os.path.join(args.tiers, "persistent"), local_every=args.save_every,
                      persistent_every=args.persistent_every, replicas=1, keep_last=2, min_free="16MiB",
                      peer_host="127.0.0.1", keep_local_on_close=True)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # every rank builds the same initial weights
    module = DemoTransformer(ModelShape(args.layers, args.dim, args.heads))
    parameters = sum(p.numel() for p in module.parameters())
    model = shard(module, wrap=(Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    events = Events(args.events, args.rank)
    if args.tiers:
        from shardckpt.tiers import CheckpointManager

        with CheckpointManager(tier_config(args)) as manager:
            restored = manager.restore(lambda storage: load_state(model, optim, storage))
            if restored is not None:
                events(event="restored", step=restored.step, tiers=restored.tiers, slowest=restored.slowest_tier,
                       seconds=restored.seconds, excluded=len(restored.excluded))
            _train_steps(args, model, optim, parameters, events, TierSaves(manager, events),
                         restored.step if restored else 0)
        return
    first = load_state(model, optim, args.resume)["step"] if args.resume else 0
    _train_steps(args, model, optim, parameters, events, Saves(events), first)


def _train_steps(args: argparse.Namespace, model, optim, parameters: int, events: Events, saves, first: int) -> None:
    events(event="started", world_size=args.world_size, step=first, resumed_from=args.resume,
           parameters=parameters)
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
    p.add_argument("--tiers", help="checkpoint with tiers below this directory (and restore from them first)")
    p.add_argument("--persistent-every", type=int, help="with --tiers: upload to tier 2 every this many steps")
    p.add_argument("--ranks-per-node", type=int, default=2, help="with --tiers: ranks of one simulated node")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    with joined(args.rank, args.world_size, args.port):
        train(args)


if __name__ == "__main__":
    main()
