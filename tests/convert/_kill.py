"""A run killed like kill -9 at a chosen point, for the resume tests of convert and export."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable


def killed_after(calls: int, module: Any, name: str, run: Callable[[], Any]) -> None:
    """``run()`` in a forked child that dies without any cleanup (``os._exit``) as it makes call number
    ``calls + 1`` to ``module.name``: the first ``calls`` calls complete (those in other threads too: a call past
    them waits for them before it kills the process)."""
    pid = os.fork()
    if pid == 0:
        real, made, done, lock = getattr(module, name), [], [0], threading.Lock()

        def dying(*args, **kwargs):
            with lock:
                made.append(1)
                n = len(made)
            if n > calls:
                while done[0] < calls:
                    time.sleep(0.001)
                os._exit(9)
            try:
                return real(*args, **kwargs)
            finally:
                with lock:
                    done[0] += 1

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
    from shardckpt.offline.spec import ConvertSpec

    real_start = mp.start_processes

    def start(fn, args, **kwargs):
        if stage != "spawned":
            fn, args = _stalling_worker, args + (stage, marks)
        context = real_start(fn, args=args, **kwargs)
        print(json.dumps({"workers": [p.pid for p in context.processes], "tracker": tracker._resource_tracker._pid}),
              flush=True)
        return context

    workers.mp.start_processes = start
    workers.convert_in_workers(ConvertSpec(src, dst, world_size=3, workers=2))
    sys.exit(0)


def _stalling_worker(rank: int, world: int, port: int, queue, spec, parent: int, stage: str, marks: str) -> None:
    """The real worker, stopped for good at ``stage`` (see ``parent_of_workers``) after writing its mark."""
    import time

    from shardckpt.offline import chunk_output, workers

    def stop() -> None:
        open(os.path.join(marks, str(rank)), "w").close()
        time.sleep(3600)

    if stage == "rendezvous" and rank == 1:
        workers.die_with_parent(parent)
        stop()
    if stage == "writing":
        chunk_output.write_file = lambda *args, **kwargs: stop()
    elif rank == 0:
        open(os.path.join(marks, str(rank)), "w").close()
    workers._worker(rank, world, port, queue, spec, parent)
