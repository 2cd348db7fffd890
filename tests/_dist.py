"""Multi-process test harness: persistent pools of gloo ranks on loopback, one pool per world size.

Starting a process that imports torch costs seconds, so each world size gets one pool of spawned
workers, created on first use and kept for the whole session. Every worker joins the pool's default
gloo process group once; `run_ranks` then sends a module-level function to all ranks and collects
what each returns.

    from tests._dist import run_ranks
    results = run_ranks(3, my_module_level_fn, arg1, arg2, timeout=120)   # results[r] is rank r's

Rules for `fn`: a module-level function (pickled by reference, so the worker imports its module);
its arguments and return value must be picklable. A hung call throws the whole pool away (the
process group is stuck mid-collective) and the next call starts a fresh one. After a call in which
some ranks raised, a barrier checks that the group is still in step; if not, the pool is replaced.
Workers keep module-level state between calls (torch seeds, default dtype, subgroups created by
`new_group`): a test that changes global state should restore it.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any, Callable

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    # spawn hands the parent's sys.path to workers: this is how they find `tests.*` modules.
    sys.path.insert(0, _REPO_ROOT)

MAX_WORLD_SIZE = 4
# After the first rank fails, how long the others get to finish before the pool is killed:
# they are often blocked in a collective the failed rank will never join.
_FAILURE_GRACE_S = 5.0
_SHUTDOWN_S = 5.0


class RankFailedError(RuntimeError):
    """One or more ranks raised (or died); `failures` maps rank -> formatted traceback."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class RankTimeoutError(RankFailedError, TimeoutError):
    """The call did not finish in time on every rank (a deadlock, usually); the pool was killed."""


def _loopback_ifname() -> str:
    names = [name for _, name in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return names[0]


def _worker_main(rank: int, world_size: int, port: int, conn: Any, dump_path: str) -> None:
    """Body of one worker: join the default group once, then run tasks until told to stop."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    dump_file = open(dump_path, "w")  # noqa: SIM115 - lives as long as the process
    # The parent sends SIGUSR1 before killing a hung pool: the stacks end up in its error message.
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    conn.send_bytes(pickle.dumps((True, "ready")))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent went away
            break
        if message == b"stop":
            break
        conn.send_bytes(_run_task(message))
    dist.destroy_process_group()


def _run_task(message: bytes) -> bytes:
    """Unpickle and run one task; return the pickled (ok, value-or-traceback) reply."""
    try:
        parent_path, fn, args = pickle.loads(message)
        # Test modules imported after the pool started may live in directories added since.
        sys.path.extend(p for p in parent_path if p not in sys.path)
        return pickle.dumps((True, fn(*args)))
    except Exception:
        return pickle.dumps((False, traceback.format_exc()))


class _Pool:
    """The workers of one world size, their pipes, and the TCPStore they rendezvous on."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        # The parent hosts the store on a port the OS picks, so there is no free-port race.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        self.dump_dir = tempfile.mkdtemp(prefix=f"shardckpt-dist{world_size}-")
        ctx = get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, self.store.port, child_end, self._dump_path(rank)),
                name=f"shardckpt-rank{rank}-of-{world_size}", daemon=True,
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def _dump_path(self, rank: int) -> str:
        return os.path.join(self.dump_dir, f"rank{rank}.txt")

    def collect(self, deadline: float, what: str) -> tuple[dict[int, Any], dict[int, str], list[int]]:
        """Wait for one reply per rank until `deadline`; stop early (after a grace) once a rank fails.

        Returns (results, failures, hung ranks); the failures include the hung ranks' stacks.
        """
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = {rank: conn for rank, conn in enumerate(self.conns)}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            ready = connection.wait(
                list(pending.values()) + [self.procs[r].sentinel for r in pending], timeout=deadline - now
            )
            for rank in list(pending):
                conn, proc = pending[rank], self.procs[rank]
                if conn in ready:
                    try:
                        ok, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        proc.join(1.0)
                        ok, value = False, f"rank {rank} died (exit code {proc.exitcode}) during {what}"
                elif proc.sentinel in ready:
                    proc.join(1.0)
                    ok, value = False, f"rank {rank} died (exit code {proc.exitcode}) during {what}"
                else:
                    continue
                del pending[rank]
                if ok:
                    results[rank] = value
                else:
                    if not failures:
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                    failures[rank] = value
        for rank, stacks in self._stack_dumps(list(pending)).items():
            failures[rank] = f"rank {rank} was still running {what} when the call was abandoned (timeout, or another rank failed); its stacks:\n{stacks}"
        return results, failures, list(pending)

    def _stack_dumps(self, ranks: list[int]) -> dict[int, str]:
        """Ask the hung ranks to dump their Python stacks (faulthandler) and read them back."""
        if not ranks:
            return {}
        for rank in ranks:
            proc = self.procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)
        dumps = {}
        for rank in ranks:
            try:
                dumps[rank] = Path(self._dump_path(rank)).read_text()
            except OSError:
                dumps[rank] = "(unavailable)"
        return dumps

    def send(self, payload: bytes) -> bool:
        """Send one task to every rank; False if a worker is gone."""
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError:
            return False
        return True

    def all_alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def aborted_ranks(self) -> list[int]:
        return [rank for rank, proc in enumerate(self.procs) if proc.exitcode == -signal.SIGABRT]

    def stop(self, graceful: bool) -> None:
        for conn in self.conns:
            try:
                if graceful:
                    conn.send_bytes(b"stop")
            except OSError:
                pass
        end = time.monotonic() + (_SHUTDOWN_S if graceful else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.dump_dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


def _get_pool(world_size: int, timeout: float) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None:
        return pool
    pool = _Pool(world_size)
    _, failures, _ = pool.collect(time.monotonic() + max(timeout, 60.0), "start-up")
    if failures:
        pool.stop(graceful=False)
        raise RankFailedError(_format(world_size, "start-up", failures), failures)
    _POOLS[world_size] = pool
    return pool


def _format(world_size: int, what: str, failures: dict[int, str]) -> str:
    parts = [f"{len(failures)} of {world_size} ranks failed in {what}:"]
    for rank in sorted(failures):
        parts.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
    return "\n".join(parts)


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, _retrying: bool = False
) -> list[Any]:
    """Run `fn(*args)` on every rank of the `world_size` pool; return the per-rank results by rank.

    Raises `RankFailedError` with every failing rank's traceback if any rank raises or dies, and
    `RankTimeoutError` (with the hung ranks' stacks) if not all ranks finish within `timeout` seconds.
    A pool with a hung or dead rank, or whose group fails a barrier afterwards, is killed; the next
    call builds a new one. A call in which a rank died by SIGABRT is run once more on a fresh pool.
    """
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
    what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    payload = pickle.dumps((list(sys.path), fn, args))
    pool = _get_pool(world_size, timeout)
    deadline = time.monotonic() + timeout
    if not pool.send(payload):
        del _POOLS[world_size]
        pool.stop(graceful=False)
        return run_ranks(world_size, fn, *args, timeout=timeout)  # a worker died between calls
    results, failures, hung = pool.collect(deadline, what)
    if not failures:
        return [results[rank] for rank in range(world_size)]
    aborted = pool.aborted_ranks()
    if hung or not pool.all_alive() or not _still_in_step(pool):
        del _POOLS[world_size]
        pool.stop(graceful=False)
    if aborted and not _retrying:
        # gloo aborts a rank now and then inside torch's own collectives on this 2-core machine
        # (SIGABRT, ~1 call in thousands): run the call once more on a fresh pool, and say so.
        print(f"tests._dist: rank(s) {aborted} aborted (SIGABRT) in {what}; retrying once on a fresh pool",
              file=sys.stderr)
        return run_ranks(world_size, fn, *args, timeout=timeout, _retrying=True)
    # Hung ranks next to a raising one were waiting for it: report that as a failure, not a timeout.
    error = RankTimeoutError if len(hung) == len(failures) else RankFailedError
    raise error(_format(world_size, what, failures), failures)


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _still_in_step(pool: _Pool) -> bool:
    """After some ranks raised, check the group still works: a rank that ran one collective more
    than its peers would leave the next collective hung, which the barrier catches."""
    if not pool.send(pickle.dumps(([], _barrier, ()))):
        return False
    _, failures, _ = pool.collect(time.monotonic() + _FAILURE_GRACE_S, "the health check")
    return not failures


def shutdown_pools() -> None:
    """Stop every pool (at session end; safe to call more than once)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.stop(graceful=True)


atexit.register(shutdown_pools)
