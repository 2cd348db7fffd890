"""A saver process for the kill -9 tests, started with ``subprocess.Popen([python, this file])``.

It imports torch once and builds two ~34 MB versions of a state dict, then obeys one command per line on
stdin (so that each kill does not pay torch's import again):

    loop PATH    fork a child that saves to PATH with overwrite=True forever, alternating versions B, A, B, ...;
                 answers ``child PID``; the child prints ``saved VERSION SECONDS`` after each commit
    reap PID     wait for that child (after the test killed it); answers ``reaped PID STATUS``
    quit         exit

The test kills the children (the processes doing the saving) with SIGKILL. ``make_state`` is also imported
by the test, to compare what it loads with both versions.
"""
from __future__ import annotations

import os
import sys
import time

VERSIONS = ("A", "B")


def make_state(version: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(VERSIONS.index(version) + 101)
    sd: dict = {"layers": {str(i): {"w": torch.randn(256, 1024, generator=g),  # 1 MiB each
                                    "b": torch.randn(1024, generator=g)} for i in range(16)},
                "embed": torch.randn(2048, 1024, generator=g).bfloat16(),  # 4 MiB
                "big": torch.randn(3 << 20, generator=g),  # 12 MiB
                "ids": torch.randint(-(2 ** 40), 2 ** 40, (1 << 18,), generator=g),  # 2 MiB
                "version": version}
    return sd


def _child(path: str, states: dict) -> None:
    import shardckpt

    i = 0
    while True:
        version = VERSIONS[(i + 1) % 2]
        t = time.monotonic()
        shardckpt.save(states[version], path, overwrite=True)
        print(f"saved {version} {time.monotonic() - t:.4f}", flush=True)
        i += 1


def _die_with_parent() -> None:
    """SIGKILL this child when the command process exits (so that no saver outlives the test)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    import torch

    torch.set_num_threads(1)  # no thread pools alive across fork()
    import shardckpt  # noqa: F401 - imported before forking, so children start at once

    states = {v: make_state(v) for v in VERSIONS}
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "loop":
            pid = os.fork()
            if pid == 0:
                try:
                    _die_with_parent()
                    _child(args[0], states)
                finally:
                    os._exit(1)
            print(f"child {pid}", flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            print(f"reaped {args[0]} {status}", flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
