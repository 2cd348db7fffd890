"""kill -9 at every step boundary of an incremental save, a pool gc and an rm, and a collector (gc, rm of the parent
+ gc) run at every boundary of a save: run as a script by tests/checkpoint/test_pool_kills.py (one process imports
torch once; each trial is a forked child, a real process, that is SIGKILLed or runs the action at its boundary).

    python tests/checkpoint/_pool_crasher.py ROOT OPS [MUTANT] [--s3 JSON]   -> one JSON line: trials and failures

``--s3 '{"url": "s3://bucket/prefix", "options": {...}}'``: the runs live there (an S3 server on 127.0.0.1), the
collector is the object-store one (leases and sweep markers; ``min_age_s=0``, so that nothing is kept for its age
alone); ROOT still holds the events files.

Every storage operation is a boundary (tests/storage/_boundaries.py: holds, writer opens, first writes, syncs,
closes, atomic puts, directory removals), and so is each pool file or manifest deletion (``pool_gc.remove_file``).
After each trial, the judge: every committed step of the run loads bit for bit the state it was saved from and
verifies; then an unkilled gc, and the judge again; then another incremental save succeeds and loads.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import shardckpt  # noqa: E402
from shardckpt.checkpoint import pool_gc, pool_leases  # noqa: E402
from shardckpt.checkpoint.gc import gc  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.io import open_storage  # noqa: E402
from shardckpt.tensor_views import as_bytes  # noqa: E402
from tests.storage import _boundaries as bnd  # noqa: E402

UNIT = 16 << 10
OPTIONS: dict | None = None  # storage options of the S3 server (None: local disk)


def place(url: str):
    return open_storage(url, OPTIONS)


def gc_run(run: str) -> None:
    gc(place(run), min_age_s=0 if OPTIONS is not None else None)


def copy_run(template: str, run: str) -> None:
    """A fresh copy of the template run at ``run`` (local: a tree copy; S3: the objects copied)."""
    if OPTIONS is None:
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(template, run)
        return
    fs = place(run).fs
    src, dst = template.split("://", 1)[1], run.split("://", 1)[1]
    if fs.exists(dst):
        fs.rm(dst, recursive=True)
    for key in fs.find(src):
        fs.copy(key, dst + key[len(src):])
    fs.invalidate_cache()


def state(step: int) -> dict:
    """A fine-tune's state at ``step``: a frozen base, an embedding whose row ``step`` moves, trained adapters."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 256, generator=g)
    emb = torch.randn(128, 64, generator=g)
    emb[step % 128] += step
    lora = torch.full((8, 8), float(step))
    head = torch.full((4096,), float(min(step, 2)))  # trained up to step 2, then frozen: steps 3, 4 reference step 2's
    return {"model": {"base": base, "emb": emb, "lora": lora, "head": head}, "optim": {"m": lora * 0.5},
            "step": step}


def save(run: str, step: int) -> None:
    shardckpt.save(state(step), f"{run}/step-{step}", incremental=True, incremental_unit=UNIT,
                   storage_options=OPTIONS)


def judge(run: str) -> list[str]:
    """What is wrong with the run: a committed step that does not load bit for bit, or does not verify."""
    wrong = []
    runs = place(run)
    for name in runs.list_dirs(""):
        if not (name.startswith("step-") and runs.exists(f"{name}/manifest.json")):
            continue
        step = int(name.split("-")[1])
        try:
            got, want = shardckpt.load_full(f"{run}/{name}", storage_options=OPTIONS), state(step)
            for k in ("base", "emb", "lora", "head"):
                if not torch.equal(as_bytes(got["model"][k]), as_bytes(want["model"][k])):
                    wrong.append(f"{name}: {k} differs")
            if got["step"] != step:
                wrong.append(f"{name}: step {got['step']}")
            report = verify(place(f"{run}/{name}"))
            if not report.ok:
                wrong.append(f"{name}: verify: {report.problems[0]}")
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    return wrong


def _rm_parent_and_gc(spec) -> None:
    """A concurrent collector at the boundary: rm of step 2 (the save's parent), then gc of the run."""
    run = spec.gc["path"]
    try:
        pool_gc.rm(place(f"{run}/step-2"), force=True)
    except Exception:  # noqa: BLE001 - already removed
        pass
    gc_run(run)


bnd.ACTIONS["rm_gc"] = _rm_parent_and_gc


def operate(op: str, run: str) -> None:
    if op.startswith("save"):
        save(run, 3)
    elif op == "gc":
        gc_run(run)
    elif op == "rm":
        pool_gc.rm(place(f"{run}/step-1"))


def child(op: str, run: str, events: str, at: int | None, action: str) -> None:
    collector = {"path": run} if OPTIONS is None else {"path": run, "storage_options": OPTIONS, "min_age_s": 0}
    bnd.install(bnd.Spec(events=events, at=at, action=action, gc=collector))
    for module in (pool_gc, pool_leases):  # each pool file, lease, marker or manifest deletion is a boundary
        bnd._wrap(module, "remove_file", lambda storage, path: f"remove_file {path}")
    operate(op, run)


def trial(op: str, template: str, run: str, at: int | None, action: str) -> tuple[int, list[str]]:
    """One forked trial; returns the boundaries counted (at=None) and what the judge found."""
    copy_run(template, run)
    events = os.path.join(ROOT, "trial.events")
    if os.path.exists(events):
        os.unlink(events)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child(op, run, events, at, action)
        except BaseException as e:  # noqa: BLE001
            print(f"child {op} at {at}: {type(e).__name__}: {e}", file=sys.stderr)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    ops = sum(1 for e in bnd.events(events) if e[0] == "op")
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    wrong = judge(run)
    if not killed and os.waitstatus_to_exitcode(status) != 0:
        wrong.append(f"exited {os.waitstatus_to_exitcode(status)} without being killed")
    gc_run(run)
    wrong += [f"after gc: {w}" for w in judge(run)]
    save(run, 4)
    wrong += [f"after a further save: {w}" for w in judge(run)]
    return ops, [f"{op} {action} at {at}: {w}" for w in wrong]


def make_template(run: str) -> None:
    """Steps 1 and 2 committed; step 0 removed after step 1 referenced its file (so the pool holds files live only
    in part, and one generation nothing names); a killed save's generation (debris)."""
    for step in (0, 1):
        save(run, step)
    pool_gc.rm(place(f"{run}/step-0"))
    save(run, 2)
    place(f"{run}/shardckpt-pool").put_atomic("data-00000000deadbeef/rank-00000-0.bin", b"x" * 100)


def mutate(name: str) -> None:
    """A protocol with one rule dropped, to show that the trials catch it: ``no_saver_holds``, the saver does not
    hold the generations it references (a collector may then delete a file it is about to name);
    ``no_saver_lease``, the same on object stores (no lease)."""
    if name == "no_saver_lease":  # object stores: the saver publishes no lease
        from shardckpt.checkpoint import incremental

        class NoLease:
            def __init__(self, *args):
                pass

            def check_fresh(self):
                pass

            def release(self):
                pass
        incremental.SaveLease = NoLease
    if name == "no_saver_holds":
        from shardckpt.checkpoint import incremental

        real = incremental.hold_generations
        incremental.hold_generations = lambda pool, gens: real(pool, {g for g in gens if len(gens) == 1})


ROOT = ""


def main() -> None:
    global OPTIONS, ROOT
    args = sys.argv[1:]
    if "--s3" in args:
        at = args.index("--s3")
        s3 = json.loads(args[at + 1])
        del args[at:at + 2]
        OPTIONS, base = s3["options"], s3["url"]
    ROOT, ops = args[0], args[1].split(",")
    if OPTIONS is None:
        base = ROOT
    if len(args) > 2:
        mutate(args[2])
    template, run = f"{base}/template", f"{base}/run"
    if OPTIONS is None:
        shutil.rmtree(template, ignore_errors=True)
    make_template(template)
    found: dict = {"trials": {}, "failures": []}
    for op in ops:
        action = {"save_gc": "gc", "save_rm_gc": "rm_gc"}.get(op, "kill")
        count, _ = trial(op, template, run, None, "kill")
        found["trials"][op] = count
        for at in range(count):
            _, wrong = trial(op, template, run, at, action)
            found["failures"] += wrong
    print(json.dumps(found))


if __name__ == "__main__":
    main()
