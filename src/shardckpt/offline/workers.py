"""``convert(..., workers=N)`` (``--workers N``): the output ranks spread over N local processes, a front door of
its own (``shardckpt.convert`` and the CLI pick it; ``offline.convert`` knows nothing of local processes).

The parent hosts a rendezvous store (``dist.world``: a port the OS picks) and spawns N workers that join a
gloo group on this machine through it and run ``offline.convert.run(spec, spread_over=group)``, the path
``torchrun`` takes:
worker ``i`` writes the output ranks ``r % N == i`` and worker 0 commits. The workers send their progress,
their report or their failure through a queue; the parent sums the progress and returns the report, or
raises worker 0's failure (every worker raises the first failure, by the spread protocol). A worker that
dies without a word (killed, out of memory) stops the others, and the parent raises ``ChildProcessError``.

Workers die with their parent, whenever it dies (``die_with_parent``): a parent killed while they start or
wait in the rendezvous would otherwise leave them asleep there, with their memory, for the store's timeout.
"""
from __future__ import annotations

import builtins
import ctypes
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Callable

import torch.multiprocessing as mp

from shardckpt import errors
from shardckpt.dist import collectives
from shardckpt.dist.world import host_store, joined
from shardckpt.errors import CheckpointError
from shardckpt.offline.convert import ConvertReport, run
from shardckpt.offline.spec import ConvertSpec


def convert_in_workers(spec: ConvertSpec, progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """The conversion ``spec`` asks for, written by ``spec.workers`` local processes; returns worker 0's report
    with every worker's kept ranks and bytes."""
    workers = spec.workers
    one = dataclasses.replace(spec, workers=1)  # what each worker writes its share of
    queue = mp.get_context("spawn").SimpleQueue()
    shares: dict[int, tuple[int, int]] = {}
    reports, failures = {}, {}

    def drain(report: bool = True) -> None:
        while not queue.empty():
            kind, rank, *payload = queue.get()
            if kind == "progress":
                shares[rank] = tuple(payload)
                if progress is not None and report:
                    progress(sum(d for d, _ in shares.values()), sum(t for _, t in shares.values()))
            elif kind == "done":
                reports[rank] = payload[0]
            else:
                failures[rank] = _rebuilt(*payload)

    store = host_store(workers)  # kept alive until the workers are done
    context = mp.start_processes(_worker, args=(workers, store.port, queue, one, os.getpid()),
                                 nprocs=workers, join=False, start_method="spawn")
    try:
        while not context.join(timeout=0.1):
            drain()
        drain()
    except mp.ProcessExitedException as e:
        raise ChildProcessError(f"convert worker {e.error_index} of {workers} died (exit code {e.exit_code}, "
                                f"signal {e.signal_name}); nothing was committed, and a rerun resumes") from None
    finally:  # whatever stopped the parent (an interrupt, a progress callback that raised) stops the workers
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join()
        drain(report=False)  # a failure's report, after an exit the loop did not see
    if failures:
        raise failures[min(failures)]
    first = reports[0]
    kept = tuple(sorted(r for report in reports.values() for r in report.kept_ranks))
    return dataclasses.replace(first, kept_ranks=kept, kept_bytes=sum(report.kept_bytes for report in reports.values()))


def _worker(rank: int, world: int, port: int, queue, spec: ConvertSpec, parent: int) -> None:
    die_with_parent(parent)
    try:
        with joined(rank, world, port):
            report = run(spec, lambda done, total: queue.put(("progress", rank, done, total)), collectives.world())
        queue.put(("done", rank, report))
    except Exception as e:  # sent to the parent, which raises it: every worker raises the same failure
        queue.put(("failed", rank, type(e).__module__, type(e).__qualname__, str(e)))


def _rebuilt(module: str, name: str, message: str) -> Exception:
    """A worker's failure as the parent raises it: the same class for shardckpt's errors and Python's own
    (sent by name and message, so that any exception arrives, picklable or not), else a CheckpointError
    with its text."""
    source = errors if module == errors.__name__ else builtins if module == "builtins" else None
    cls = getattr(source, name, None) if source is not None else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a class whose constructor wants more than a message
            pass
    return CheckpointError(f"{name}: {message}")


_PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5  # where the kernel cannot be asked (not Linux): how often a thread looks for the parent


def die_with_parent(parent: int) -> None:
    """End this process (SIGKILL) as soon as process ``parent``, which started it, dies. Linux: the kernel does it
    (``PR_SET_PDEATHSIG``); elsewhere a daemon thread watches ``getppid()``. Either way the parent is checked
    once it is armed: one that died before (while this process was starting) ends it at once."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), name="shardckpt-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # died before the watch was armed: this process was handed to another parent
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)
