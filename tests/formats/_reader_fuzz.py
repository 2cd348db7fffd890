"""Fuzzing every foreign reader's resource bounds (issue 34), in a child process whose address space and CPU time
are capped (``test_reader_fuzz.py`` runs one per format and checks its report).

Each case starts from a valid small checkpoint (``fixtures/deepspeed`` and ones made here) and damages it one
way (``_fuzz_cases``): flipped, cut or inserted bytes, truncation, hostile values (huge ints, wrong types, deep
nesting, shared-reference bombs, huge lists) at any place of an unpickled or parsed structure, stray files and
file names. Then every public entry point runs on it: ``open_reader`` with ``tensors()``, ``tree()`` and a read
of every tensor, ``load_full``, ``checkpoint.verify`` and ``checkpoint.describe``.

Allowed: a ``CheckpointError``, or success. A failure is anything else escaping a public function (``MemoryError``
under the cap, ``RecursionError``, ``TypeError``...), a public call over ``CASE_CPU`` seconds of CPU, a reader
presenting more tensor bytes than its files hold (times ``PRESENT_FACTOR``), or, where the format checksums what a case
damaged (``exact``), a load that succeeds with other bytes than the original's under an original name. A case
that kills the process (the memory or CPU cap) fails the run; ``progress`` names it. Before the cases, an
allocation past the cap must fail (else the cap is not in effect and the run fails).

    python tests/formats/_reader_fuzz.py FORMAT WORKDIR CASES SEED    # prints one JSON line
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import traceback
from collections import Counter

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import shardckpt  # noqa: E402
from shardckpt.checkpoint.describe import describe  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.errors import CheckpointError  # noqa: E402
from shardckpt.formats.api import ReadRequest  # noqa: E402
from shardckpt.formats.detect import open_reader  # noqa: E402
from shardckpt.regions import full_region  # noqa: E402
from shardckpt.tensor_views import as_bytes  # noqa: E402
from tests.formats._fuzz_cases import FORMATS  # noqa: E402
from tests.formats._fuzz_values import flat_tensors  # noqa: E402

MEMORY_CAP = 384 << 20  # address space allowed above what the process maps once set up (torch imported)
CPU_CAP = 600  # seconds of CPU for the whole run: the cap that kills
CASE_CPU = 10  # seconds of CPU per public call in a case: over it is a failure (and the case is abandoned)
PRESENT_FACTOR = 4  # a reader may present at most this many times its files' bytes (ties, state beside weights)


class CaseTimeout(BaseException):
    """Raised by the CPU timer inside a case that ran too long (a BaseException: no ``except Exception`` eats it)."""


def _on_timer(signum, frame):
    raise CaseTimeout()


def _bytes_of(t: torch.Tensor) -> bytes:
    return bytes(as_bytes(t.contiguous()).numpy())


def _files_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.isfile(os.path.join(d, f)))


def _read_everything(path: str) -> None:
    reader = open_reader(path)
    infos = reader.tensors()
    reader.tree()
    presented = sum(i.dtype.itemsize * math.prod(i.shape) for i in infos.values())
    limit = PRESENT_FACTOR * _files_bytes(path) + (1 << 20)
    if presented > limit:
        raise AssertionError(f"presents {presented} tensor bytes from {_files_bytes(path)} bytes of files")
    dests = {n: torch.empty(i.shape, dtype=i.dtype) for n, i in infos.items()}
    reader.read([ReadRequest(n, full_region(tuple(t.shape)), t) for n, t in dests.items()])


class Run:
    def __init__(self, fmt: str, work: str, seed: int):
        self.fmt, self.work = fmt, work
        self.rng = random.Random(seed)
        self.cases = FORMATS[fmt](os.path.join(work, "base"), self.rng)
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.progress = os.path.join(work, "progress")

    def _call(self, what: str, fn, case: str) -> tuple[bool, object]:
        """(ok, result): ok False where it refused with a CheckpointError; a failure is recorded and re-raised as
        StopIteration so the case ends. Each call gets ``CASE_CPU`` seconds: a case runs four public calls, and each
        one reads the damaged checkpoint from scratch (a 2 MB pickle nesting a million deep costs ~2.6 s a call)."""
        signal.setitimer(signal.ITIMER_PROF, CASE_CPU)
        try:
            return True, fn()
        except CheckpointError:
            return False, None
        except CaseTimeout:
            self.failures.append(f"[{case}] {what}: over {CASE_CPU} s of CPU")
            raise StopIteration from None
        except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
            tb = traceback.format_exc(limit=-6)[-1500:]
            self.failures.append(f"[{case}] {what}: {type(e).__name__}: {str(e)[:300]}\n{tb}")
            raise StopIteration from None

    def one(self, i: int) -> None:
        case_dir = os.path.join(self.work, f"case{i % 2}")
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(case_dir)
        for _ in range(20):  # a mutation that cannot be written (pickling refuses it) is drawn again
            try:
                kind, path, what, original = self.cases.make(case_dir, i)
                break
            except (TypeError, ValueError, RuntimeError, pickle.PicklingError, AttributeError):
                shutil.rmtree(case_dir, ignore_errors=True)
                os.makedirs(case_dir)
        case = f"{self.fmt} #{i} {kind}: {what}"
        with open(self.progress, "w") as f:
            f.write(case)
        self.counts[kind] += 1
        try:
            with _capped():
                opened = self._exercise(path, original, case)
            self.counts["read" if opened else "refused"] += 1
        except StopIteration:
            self.counts["failed"] += 1

    def _exercise(self, path: str, original: dict | None, case: str) -> bool:
        """Every public entry point on ``path``; whether the reader read it all (else it refused)."""
        read = False
        for name, fn in (("open_reader/tensors/tree/read", lambda: _read_everything(path)),
                         ("load_full", lambda: shardckpt.load_full(path)), ("verify", lambda: verify(path)),
                         ("describe", lambda: describe(path))):
            ok, result = self._call(name, fn, case)
            read = read or (ok and name.startswith("open_reader"))
            if ok and name == "load_full" and original is not None:
                self._compare(flat_tensors(result), original, case)
        return read

    def _compare(self, loaded: dict, original: dict, case: str) -> None:
        for name, t in loaded.items():
            if name in original and (t.dtype != original[name].dtype or _bytes_of(t) != _bytes_of(original[name])):
                self.failures.append(f"[{case}] load_full: wrong bytes for {name!r} with no error")
                raise StopIteration


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _capped():
    """The address space capped at ``MEMORY_CAP`` above what the process maps now, while a case's checkpoint is
    read (not while it is made); ``_call`` sets a CPU timer of ``CASE_CPU`` seconds per public call."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + MEMORY_CAP, hard))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _cap_cpu() -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + CPU_CAP
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _check_the_cap(run: Run) -> None:
    """The memory cap is in effect: allocating past it fails (else the run fails: it would prove nothing)."""
    try:
        with _capped():
            bytearray(MEMORY_CAP + (64 << 20))
        run.failures.append(f"allocating {MEMORY_CAP + (64 << 20)} bytes under the memory cap succeeded")
    except MemoryError:
        pass


def main() -> None:
    fmt, work, cases, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    signal.signal(signal.SIGPROF, _on_timer)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    run = Run(fmt, work, seed)
    _cap_cpu()
    _check_the_cap(run)
    for i in range(cases):
        run.one(i)
    print(json.dumps({"format": fmt, "cases": cases, **run.counts, "failures": run.failures[:20],
                      "failure_count": len(run.failures)}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
