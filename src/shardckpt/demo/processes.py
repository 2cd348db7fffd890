"""The processes the demo runs: training ranks it can kill for real, and ``shardckpt`` commands it times.

Training ranks are separate Python processes (``python -m shardckpt.demo.train``) that join a gloo world
through a rendezvous store hosted here, so that ``kill()`` is a real SIGKILL of real processes, as a
node failure would be. Commands run as ``python -m shardckpt.cli.main VERB ...``, exactly what a user
types, and ``run_measured`` gives each one's own peak memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from shardckpt.demo.config import DemoError
from shardckpt.dist.world import host_store


@dataclasses.dataclass
class CommandResult:
    returncode: int
    output: str
    seconds: float
    peak_rss_bytes: int


def run_command(verb: str, *args: str, log: str) -> CommandResult:
    """Run ``shardckpt VERB ARGS...``; its output goes to ``log`` (and is returned)."""
    t = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        returncode, peak_rss, _ = run_measured([sys.executable, "-m", "shardckpt.cli.main", verb, *args], out,
                                               subprocess.STDOUT)
    with open(log, encoding="utf-8") as f:
        output = f.read()
    return CommandResult(returncode, output, time.perf_counter() - t, peak_rss)


# A process started straight from this one would report this process's peak RSS if larger than its own:
# subprocess starts children with vfork, and Linux keeps the peak of the address space a child replaces at
# exec. So a small launcher, a few MiB, starts the command and reports what os.wait4 says of it.
_LAUNCHER = """import json, os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(p.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump([os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime], f)
"""


def run_measured(cmd: list[str], stdout, stderr) -> tuple[int, int, float]:
    """Run ``cmd`` to its end: its exit code, its own peak RSS in bytes, its user + system CPU seconds."""
    fd, report = tempfile.mkstemp(prefix="shardckpt-rss-", suffix=".json")
    os.close(fd)
    try:
        launcher = subprocess.run([sys.executable, "-I", "-S", "-c", _LAUNCHER, report, *cmd],
                                  stdout=stdout, stderr=stderr)
        if launcher.returncode != 0:
            return launcher.returncode, 0, 0.0
        with open(report, encoding="utf-8") as f:
            returncode, peak_rss, cpu = json.load(f)
        return returncode, peak_rss, cpu
    finally:
        os.remove(report)


def checked_command(verb: str, *args: str, log: str) -> CommandResult:
    """``run_command``, raising ``DemoError`` with the command's last output when it fails."""
    result = run_command(verb, *args, log=log)
    if result.returncode != 0:
        raise DemoError(f"`shardckpt {verb} {' '.join(args)}` exited with {result.returncode}:\n"
                        f"{result.output.strip()[-2000:]}\n(log: {log})")
    return result


class TrainingRanks:
    """``world_size`` training processes of ``shardckpt.demo.train``, each logging to ``logs/<tag>-rank<R>.log``."""

    def __init__(self, world_size: int, train_args: list[str], logs: str, tag: str) -> None:
        self.store = host_store(world_size)  # kept alive until the ranks are done
        self.logs = [os.path.join(logs, f"{tag}-rank{rank}.log") for rank in range(world_size)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "w", encoding="utf-8") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "shardckpt.demo.train", "--rank", str(rank), "--world-size",
                     str(world_size), "--port", str(self.store.port), *train_args],
                    stdout=out, stderr=subprocess.STDOUT))

    def check(self) -> bool:
        """True once every rank exited 0; raises ``DemoError`` (after killing the rest) if one failed."""
        codes = [p.poll() for p in self.procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            self.kill()
            rank, code = failed[0]
            raise DemoError(f"training rank {rank} exited with {code}:\n{_tail(self.logs[rank])}\n(log: {self.logs[rank]})")
        return all(code == 0 for code in codes)

    def kill(self) -> None:
        """SIGKILL every rank, as a node failure would, and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()


class EventTail:
    """The JSON lines rank 0 appends to its event log, read as they arrive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line]


def _tail(path: str, lines: int = 30) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()
