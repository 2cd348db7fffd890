"""The writer x collector x kill matrix (issue 34): for every writer, on local disk and on S3, at every step
boundary of the writer (``_boundaries``: each storage operation, numbered, and the windows inside two of them),
run ``gc`` there, run a second writer to the same path there, or SIGKILL the writer there. Then every verb
(``load_full``, ``load``, ``inspect``, ``verify``, ``convert``, ``export``, ``diff``) must read exactly the
output committed last (the events file says which) or refuse with a ``CheckpointError``: nothing partial or
mixed is ever read as whole. Writers whose commit is one atomic step (a manifest) must moreover never be
unreadable once something was committed. A writer running beside ``gc`` must succeed, and a writer beside a
second writer succeeds or is refused with a ``CheckpointError``.

    pytest tests/storage/test_writer_matrix.py -s     # prints the matrix: cases, boundaries, outcomes

Local disk runs every boundary of every writer but ``convert --workers``, which spawns two worker processes per
run (seconds each) and so runs a sample (``_sample``), as S3 does (moto on 127.0.0.1: tens of requests per
case), except for the exports' kills, which run at every boundary there (an unfinished export on an object
store lies under its final names). ``gc`` on S3 goes by age (6 hours): there it must remove nothing.
``SHARDCKPT_MATRIX_FULL=1`` runs every boundary everywhere.
"""
from __future__ import annotations

import collections
import os
import uuid
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

import shardckpt
from shardckpt.offline import workers as workers_module
from shardckpt.offline.export import export
from tests.storage import _boundaries as bnd
from tests.storage._matrix import VERSIONS, Cases, where

FULL = os.environ.get("SHARDCKPT_MATRIX_FULL") == "1"
SHARD = 1600  # export's max_shard_size: 3 files


def state(version: str) -> dict:
    g = torch.Generator().manual_seed(VERSIONS.index(version) + 7)
    return {"model": {"w": torch.randn(24, 16, generator=g), "b": torch.randn(16, generator=g).bfloat16(),
                      "v": torch.randn(300, generator=g), "i": torch.arange(40) * (VERSIONS.index(version) + 1)},
            "step": VERSIONS.index(version)}


# The writers, as module-level functions: the second writer's process calls them by name.

def save_version(root: str, version: str, dst: str, options: dict | None) -> None:
    shardckpt.save(state(version), dst, overwrite=True, storage_options=options)


def async_save_version(root: str, version: str, dst: str, options: dict | None) -> None:
    shardckpt.async_save(state(version), dst, overwrite=True, storage_options=options).wait()


def pooled_state(version: str) -> dict:
    """``state`` and a frozen tensor that every version shares: an incremental save references it."""
    return {**state(version), "frozen": torch.arange(3000, dtype=torch.float32)}


def save_incremental_version(root: str, version: str, dst: str, options: dict | None) -> None:
    shardckpt.save(pooled_state(version), dst, overwrite=True, storage_options=options, incremental=True,
                   incremental_unit=4096)


def async_save_incremental_version(root: str, version: str, dst: str, options: dict | None) -> None:
    shardckpt.async_save(pooled_state(version), dst, overwrite=True, storage_options=options, incremental=True,
                         incremental_unit=4096).wait()


def convert_version(root: str, version: str, dst: str, options: dict | None, workers: int = 1) -> None:
    shardckpt.convert(os.path.join(root, f"src-{version}"), dst, world_size=2, overwrite=True,
                      dst_storage_options=options, workers=workers)  # workers > 1: the local processes' front door


def export_version(root: str, version: str, dst: str, options: dict | None, overwrite: bool = False) -> None:
    export(os.path.join(root, f"src-{version}"), dst, max_shard_size=SHARD, overwrite=overwrite,
           dst_storage_options=options)


def export_foreign_version(root: str, version: str, dst: str, options: dict | None) -> None:
    """A safetensors file (a source without identity) exported by one relative path for every version, each
    from a working directory of its own: the versions' headers are alike but for the export_id."""
    here = os.getcwd()
    os.chdir(os.path.join(root, f"foreign-{version}"))
    try:
        export("src.safetensors", dst, max_shard_size=SHARD, overwrite=True, dst_storage_options=options)
    finally:
        os.chdir(here)


@dataclass(frozen=True)
class Writer:
    name: str
    function: str  # of this module
    kwargs: dict
    initial: str  # what the path holds before: "old" (that version's output) or "none"
    atomic: bool  # one atomic commit (a manifest): what was committed stays readable at every instant
    workers: bool = False
    second: dict | None = None  # the second writer's kwargs, where not the same (convert --workers: one process)
    events: tuple[str, ...] = ("gc", "writer2", "kill")  # of _matrix.EVENTS
    identical_twins: bool = False  # two runs of one command write the same bytes (a source with identity)
    gc_run: bool = False  # gc the run directory (the pool's sweep) instead of the output's path

    def call(self, root: str, version: str, dst: str, options: dict | None, second: bool = False) -> dict:
        kwargs = self.second if second and self.second is not None else self.kwargs
        return {"call": f"{__name__}:{self.function}", "args": [root, version, dst, options], "kwargs": kwargs}


CONVERTS = ("gc", "writer2", "twin", "kill")
EXPORTS = ("gc", "writer2", "twin", "writer2-kill", "kill")
WRITERS = {w.name: w for w in [
    Writer("save", "save_version", {}, "old", True),
    Writer("async_save", "async_save_version", {}, "old", True),
    Writer("save incremental", "save_incremental_version", {}, "old", True, gc_run=True),
    Writer("async_save incremental", "async_save_incremental_version", {}, "old", True, gc_run=True),
    Writer("convert", "convert_version", {}, "old", True, events=CONVERTS, identical_twins=True),
    Writer("convert --workers", "convert_version", {"workers": 2}, "old", True, workers=True, second={},
           events=CONVERTS, identical_twins=True),
    Writer("export", "export_version", {}, "none", False, events=EXPORTS, identical_twins=True),
    Writer("export --overwrite", "export_version", {"overwrite": True}, "old", False, events=EXPORTS,
           identical_twins=True),
    # writer2: another file at the same path as given, so the same headers but for the export_id
    Writer("export foreign --overwrite", "export_foreign_version", {}, "old", False,
           events=("writer2", "twin", "writer2-kill", "kill")),
]}

@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("matrix-src"))
    for v in VERSIONS:
        shardckpt.save(state(v), os.path.join(root, f"src-{v}"))
        os.makedirs(os.path.join(root, f"foreign-{v}"))
        save_file(state(v)["model"], os.path.join(root, f"foreign-{v}", "src.safetensors"))
    return root


@pytest.fixture(scope="module")
def second_writer(tmp_path_factory):
    server = bnd.SecondWriter(str(tmp_path_factory.mktemp("matrix-w2")))
    yield server
    server.close()


@pytest.fixture(scope="module")
def matrix():
    rows: dict = {}
    yield rows
    _print_matrix(rows)


@pytest.fixture(scope="module")
def matrix_bucket(s3_server):
    """One bucket for the module's S3 cells (each writer its own prefix): no reset between them."""
    bucket = f"matrix-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    return s3_server, bucket

def _sample(ops: list, commit: int, writer: Writer, kind: str, event: str) -> list:
    """The boundaries a cell runs: every one, but where a case costs seconds (convert --workers spawns its
    workers) or tens of requests (S3), and for the second writers added later (twin, writer2-kill, and the
    foreign export's): the first operation, one amid the data, the commit and the one after it, the last; on
    S3 every one for the exports' kills and twins (an unfinished export there is under its final names), and
    two for gc (which goes by age there: it must remove nothing). writer2-kill runs where the writer opens a
    data file (``_opened_files``): at each on S3, at one on local disk (its files are its own until the
    commit there)."""
    if event == "writer2-kill":
        opened = _opened_files(ops)
        return opened if FULL or kind == "s3" else opened[len(opened) // 2:][:1]
    if FULL or (kind == "local" and not writer.workers and event in ("gc", "writer2", "kill")
                and not writer.name.startswith("export foreign")):
        return ops
    if writer.workers:  # gc at worker 0's first operation (its directory's hold), the others at its commit
        zero, one = ([op for op in ops if op[0] == w] for w in (0, 1))  # (a kill also amid worker 1's data)
        at_commit = next(op for op in zero if op[2] == "put_atomic manifest.json")
        if event == "gc":
            return [zero[0]]
        return [at_commit] if event in ("writer2", "twin") else [one[len(one) // 2], at_commit]
    if writer.name.startswith("export") and kind == "s3" and event in ("kill", "twin"):
        return ops
    picks = {0, commit} if event == "gc" else {0, len(ops) // 2, commit, min(commit + 1, len(ops) - 1), len(ops) - 1}
    return [ops[i] for i in sorted(picks)]


def _opened_files(ops: list) -> list:
    """The boundaries where an export opens a data file (``open_writer``; its check for another export's
    commit is behind it)."""
    return [op for op in ops if op[2].startswith("open_writer") and ".safetensors" in op[2]]


def _kill_after_file(ops: list, op: tuple) -> int:
    """The close of the file that ``op`` opens: the writer is killed once it returns (the file written whole,
    over the second writer's file of that name on an object store)."""
    name = op[2].split()[-1].rsplit("/", 1)[-1]
    return next(o[1] for o in ops[ops.index(op):] if o[2] == f"close {name}")


PARAMS = [pytest.param(name, kind, event, id=f"{name}-{kind}-{event}".replace(" --", "-").replace(" ", "-"))
          for name, writer in WRITERS.items() for kind in ("local", "s3") for event in writer.events]


@pytest.fixture(scope="module")
def cases_cache():
    return {}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, kind, event", PARAMS)
def test_writer_matrix(name, kind, event, request, tmp_path_factory, sources, second_writer, matrix, cases_cache,
                       monkeypatch):
    writer = WRITERS[name]
    monkeypatch.setattr(workers_module, "_worker", bnd.worker)
    key = (name, kind)
    if key not in cases_cache:
        place = where(kind, str(tmp_path_factory.mktemp("matrix")),
                      request.getfixturevalue("matrix_bucket") if kind == "s3" else None)
        cases = Cases(writer, place, sources, second_writer, str(tmp_path_factory.mktemp("matrix-scratch")))
        cases_cache[key] = (cases, *cases.boundaries())
    cases, ops, commit = cases_cache[key]
    chosen = _sample(ops, commit, writer, kind, event)
    row = matrix.setdefault((name, kind, event), {"boundaries": len(ops), "cases": 0, "outcomes": collections.Counter(),
                                                  "read": collections.Counter(), "problems": []})
    for worker, k, label in chosen:
        kill_at = _kill_after_file(ops, (worker, k, label)) if event == "writer2-kill" else None
        case = cases.run(event, worker, k, kill_at)
        verdict, problems = cases.judge(case, event)
        row["cases"] += 1
        row["outcomes"][case["outcome"].split(":")[0]] += 1
        row["read"][verdict] += 1
        at = f"boundary {k}{'' if worker is None else f' of worker {worker}'} ({label})"
        row["problems"] += [f"{at}: {p}" for p in problems]
    assert not row["problems"], "\n".join(row["problems"][:20])


def _print_matrix(rows: dict) -> None:
    if not rows:
        return
    lines = ["", "writer x collector x kill matrix (cases run / boundaries of the writer; the writer's outcomes; "
                 "what every verb then read: the version committed last, or refused)"]
    width = max(len(f"{n} [{k}] {e}") for n, k, e in rows) + 2
    for (name, kind, event), row in rows.items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(row["outcomes"].items()))
        read = ", ".join(f"{k} {v}" for k, v in sorted(row["read"].items()))
        head = f"{name} [{kind}] {event}".ljust(width)
        lines.append(f"{head}{row['cases']:4d} / {row['boundaries']:3d}   writer: {outcomes};   read: {read}"
                     f"{'   PROBLEMS: %d' % len(row['problems']) if row['problems'] else ''}")
    total = sum(r["cases"] for r in rows.values())
    lines.append(f"{total} cases in {len(rows)} cells, {sum(len(r['problems']) for r in rows.values())} problems")
    print("\n".join(lines))
