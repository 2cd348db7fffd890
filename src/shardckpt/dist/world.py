"""Joining and leaving a gloo world from spawned processes (the demo's ranks). The parent hosts the rendezvous
store on a port the OS picks, so no free-port guess can race with another process. And the world torchrun
started a command in (``torchrun_world``), for the CLI."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch.distributed as dist


def host_store(world_size: int) -> Any:
    """The rendezvous store for `world_size` ranks, hosted by the calling (parent) process: pass its `port` to
    `joined` in each rank, and keep it alive until they are done."""
    return dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)


@contextlib.contextmanager
def joined(rank: int, world_size: int, port: int) -> Iterator[None]:
    """Be `rank` of a gloo world of `world_size` (the default group) for the body, then leave it. After a body
    that returns, every rank waits for the others first: nobody tears the group down while a peer still
    finishes its last collective."""
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def torchrun_world() -> Iterator[Any]:
    """The default process group (gloo) for the body, when torchrun started several copies of this process; else
    None (and nothing is joined)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        yield None
        return
    dist.init_process_group("gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
