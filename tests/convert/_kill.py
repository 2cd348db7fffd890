"""A run killed like kill -9 at a chosen point, for the resume tests of convert and export."""
from __future__ import annotations

import os
from typing import Any, Callable


def killed_after(calls: int, module: Any, name: str, run: Callable[[], Any]) -> None:
    """``run()`` in a forked child that dies without any cleanup (``os._exit``) as it makes call number
    ``calls + 1`` to ``module.name``: the first ``calls`` calls complete."""
    pid = os.fork()
    if pid == 0:
        real, made = getattr(module, name), []

        def dying(*args, **kwargs):
            made.append(1)
            if len(made) > calls:
                os._exit(9)
            return real(*args, **kwargs)

        setattr(module, name, dying)
        try:
            run()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 9, "the run ended before the kill point"


def parent_of_workers(src: str, dst: str, stage: str, marks: str) -> None:
    """A ``convert(..., workers=2)`` parent for the orphan tests (run as its own process, killed by the test):
    prints one JSON line with its workers' and resource tracker's pids once they are started, then waits for
    them. At ``stage`` ``"spawned"`` the workers run as they are (the test kills the parent while they start
    up); at ``"rendezvous"`` worker 1 never joins, so that worker 0 waits in the rendezvous; at ``"writing"``
    each worker stops as it starts writing its first output rank. Each worker writes ``marks``/<rank> there."""
    import json
    import multiprocessing.resource_tracker as tracker
    import sys

    import torch.multiprocessing as mp

    from shardckpt.offline import workers
    from shardckpt.offline.convert import convert

    real_start = mp.start_processes

    def start(fn, args, **kwargs):
        if stage != "spawned":
            fn, args = _stalling_worker, args + (stage, marks)
        context = real_start(fn, args=args, **kwargs)
        print(json.dumps({"workers": [p.pid for p in context.processes], "tracker": tracker._resource_tracker._pid}),
              flush=True)
        return context

    workers.mp.start_processes = start
    convert(src, dst, world_size=3, workers=2)
    sys.exit(0)


def _stalling_worker(rank: int, world: int, port: int, queue, src, dst, options: dict, parent: int, stage: str,
                     marks: str) -> None:
    """The real worker, stopped for good at ``stage`` (see ``parent_of_workers``) after writing its mark."""
    import time

    import shardckpt.offline.convert as convert_module
    from shardckpt.offline import workers

    def stop() -> None:
        open(os.path.join(marks, str(rank)), "w").close()
        time.sleep(3600)

    if stage == "rendezvous" and rank == 1:
        workers.die_with_parent(parent)
        stop()
    if stage == "writing":
        convert_module.write_rank_files = lambda *args, **kwargs: stop()
    elif rank == 0:
        open(os.path.join(marks, str(rank)), "w").close()
    workers._worker(rank, world, port, queue, src, dst, options, parent)
