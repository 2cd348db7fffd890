"""kill -9 at every step boundary of an incremental save, a pool gc and an rm, and a collector (gc, rm of the parent
+ gc) run at every boundary of a save: run as a script by tests/checkpoint/test_pool_kills.py (one process imports
torch once; each trial is a forked child, a real process, that is SIGKILLed or runs the action at its boundary).

    python tests/checkpoint/_pool_crasher.py ROOT OPS   -> prints one JSON line: trials per case and failures

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
from shardckpt.checkpoint import pool_gc  # noqa: E402
from shardckpt.checkpoint.gc import gc  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.tensor_views import as_bytes  # noqa: E402
from tests.storage import _boundaries as bnd  # noqa: E402

UNIT = 16 << 10


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
    shardckpt.save(state(step), os.path.join(run, f"step-{step}"), incremental=True, incremental_unit=UNIT)


def judge(run: str) -> list[str]:
    """What is wrong with the run: a committed step that does not load bit for bit, or does not verify."""
    wrong = []
    for name in sorted(os.listdir(run)):
        if not (name.startswith("step-") and os.path.exists(os.path.join(run, name, "manifest.json"))):
            continue
        step = int(name.split("-")[1])
        try:
            got, want = shardckpt.load_full(os.path.join(run, name)), state(step)
            for k in ("base", "emb", "lora", "head"):
                if not torch.equal(as_bytes(got["model"][k]), as_bytes(want["model"][k])):
                    wrong.append(f"{name}: {k} differs")
            if got["step"] != step:
                wrong.append(f"{name}: step {got['step']}")
            report = verify(os.path.join(run, name))
            if not report.ok:
                wrong.append(f"{name}: verify: {report.problems[0]}")
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    return wrong


def _rm_parent_and_gc(spec) -> None:
    """A concurrent collector at the boundary: rm of step 2 (the save's parent), then gc of the run."""
    run = spec.gc["path"]
    try:
        pool_gc.rm(os.path.join(run, "step-2"), force=True)
    except Exception:  # noqa: BLE001 - already removed
        pass
    gc(run)


bnd.ACTIONS["rm_gc"] = _rm_parent_and_gc


def operate(op: str, run: str) -> None:
    if op.startswith("save"):
        save(run, 3)
    elif op == "gc":
        gc(run)
    elif op == "rm":
        pool_gc.rm(os.path.join(run, "step-1"))


def child(op: str, run: str, events: str, at: int | None, action: str) -> None:
    bnd.install(bnd.Spec(events=events, at=at, action=action, gc={"path": run}))
    bnd._wrap(pool_gc, "remove_file", lambda storage, path: f"remove_file {path}")
    operate(op, run)


def trial(op: str, template: str, run: str, at: int | None, action: str) -> tuple[int, list[str]]:
    """One forked trial; returns the boundaries counted (at=None) and what the judge found."""
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(template, run)
    events = run + ".events"
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
    gc(run)
    wrong += [f"after gc: {w}" for w in judge(run)]
    save(run, 4)
    wrong += [f"after a further save: {w}" for w in judge(run)]
    return ops, [f"{op} {action} at {at}: {w}" for w in wrong]


def make_template(run: str) -> None:
    """Steps 1 and 2 committed; step 0 removed after step 1 referenced its file (so the pool holds files live only
    in part, and one generation nothing names); a killed save's generation (debris)."""
    for step in (0, 1):
        save(run, step)
    pool_gc.rm(os.path.join(run, "step-0"))
    save(run, 2)
    debris = os.path.join(run, "shardckpt-pool", "data-00000000deadbeef")
    os.makedirs(debris)
    with open(os.path.join(debris, "rank-00000-0.bin"), "wb") as f:
        f.write(b"x" * 100)


def mutate(name: str) -> None:
    """A protocol with one rule dropped, to show that the trials catch it: ``no_saver_holds``, the saver does not
    hold the generations it references (a collector may then delete a file it is about to name)."""
    if name == "no_saver_holds":
        from shardckpt.checkpoint import incremental

        real = incremental.hold_generations
        incremental.hold_generations = lambda pool, gens: real(pool, {g for g in gens if len(gens) == 1})


def main() -> None:
    root, ops = sys.argv[1], sys.argv[2].split(",")
    if len(sys.argv) > 3:
        mutate(sys.argv[3])
    template = os.path.join(root, "template")
    shutil.rmtree(template, ignore_errors=True)
    make_template(template)
    found: dict = {"trials": {}, "failures": []}
    for op in ops:
        action = {"save_gc": "gc", "save_rm_gc": "rm_gc"}.get(op, "kill")
        count, _ = trial(op, template, os.path.join(root, "run"), None, "kill")
        found["trials"][op] = count
        for at in range(count):
            _, wrong = trial(op, template, os.path.join(root, "run"), at, action)
            found["failures"] += wrong
    print(json.dumps(found))


if __name__ == "__main__":
    main()
