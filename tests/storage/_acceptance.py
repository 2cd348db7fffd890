"""The acceptance trial of issue 39, run as a script by tests/storage/test_incremental_acceptance.py:

    python tests/storage/_acceptance.py ROOT SEED   -> prints one JSON line (events, failures, bytes)

Ten incremental saves of a LoRA fine-tune (a frozen 4-layer base of ~1 MiB fp32, rank-4 adapters trained with AdamW,
one optimizer step between saves; deterministic: seeded, one thread). Each save is first made by a forked process
(a real one) that is SIGKILLed at a storage operation drawn from that save's count, then made again unkilled (the
restart). After each save, with probability 0.3 an ``rm`` of a random committed step other than the latest (itself
killed at a random boundary with probability 0.3), then a ``gc`` of the run killed likewise, then an unkilled
``gc``. After every event, every committed step must load bit for bit the state it was saved from, and verify; the
latest must be the step last saved. At the end: the bytes on disk (every file under the run directory) against ten
full saves of the same states.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import shardckpt  # noqa: E402
from shardckpt.checkpoint import pool_gc  # noqa: E402
from shardckpt.checkpoint.gc import gc  # noqa: E402
from shardckpt.checkpoint.latest import latest_checkpoint  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.tensor_views import as_bytes  # noqa: E402
from tests.storage import _boundaries as bnd  # noqa: E402

STEPS = 10


class LoRALinear(nn.Module):
    def __init__(self, n: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, n) * 0.01)
        self.b = nn.Parameter(torch.zeros(n, rank))

    def forward(self, x):
        return self.base(x) + x @ self.a.T @ self.b.T


def reference_states() -> list[dict]:
    """The fine-tune's state after each of ``STEPS`` optimizer steps (model and AdamW state, cloned)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[LoRALinear(256) for _ in range(4)])
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    states = []
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sd = {"model": {k: v.clone() for k, v in model.state_dict().items()},
              "optim": _clone(optim.state_dict()), "step": step}
        states.append(sd)
    return states


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, (dict, list)):
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _tensors(v, f"{prefix}.{k}")


def step_path(run: str, step: int) -> str:
    return os.path.join(run, f"step-{step:06d}")


def save(run: str, states: list[dict], step: int) -> None:
    shardckpt.save(states[step - 1], step_path(run, step), incremental=True, overwrite=True)


def judge(run: str, states: list[dict], last: int, or_next: bool = False) -> list[str]:
    """What is wrong: a committed step that does not load bit for bit its state, or does not verify; a latest
    other than ``last`` (``or_next``: or ``last + 1``, a save killed after its commit, in its tidy-up)."""
    wrong = []
    for name in sorted(os.listdir(run)):
        if not (name.startswith("step-") and os.path.exists(os.path.join(run, name, "manifest.json"))):
            continue
        step = int(name.split("-")[1])
        try:
            got, want = dict(_tensors(shardckpt.load_full(os.path.join(run, name)))), dict(_tensors(states[step - 1]))
            if got.keys() != want.keys():
                wrong.append(f"{name}: keys differ")
            wrong += [f"{name}: {k} differs" for k in want if k in got and
                      not torch.equal(as_bytes(got[k].contiguous()), as_bytes(want[k].contiguous()))]
            if not verify(os.path.join(run, name)).ok:
                wrong.append(f"{name}: does not verify")
        except Exception as e:  # noqa: BLE001
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    latest = latest_checkpoint(run)
    allowed = {f"step-{last:06d}"} | ({f"step-{last + 1:06d}"} if or_next else set())
    if last and (latest is None or os.path.basename(latest) not in allowed):
        wrong.append(f"latest is {latest}, the last save was step {last}")
    return wrong


def forked(fn, events: str, at: int | None) -> bool:
    """``fn()`` in a forked process whose storage operations are numbered, SIGKILLed at operation ``at``; returns
    whether it was killed. The count of its operations is left in ``events``."""
    if os.path.exists(events):
        os.unlink(events)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            bnd.install(bnd.Spec(events=events, at=at, action="kill"))
            bnd._wrap(pool_gc, "remove_file", lambda storage, path: f"remove_file {path}")
            fn()
        except BaseException as e:  # noqa: BLE001
            print(f"forked: {type(e).__name__}: {e}", file=sys.stderr)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if not killed and os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the forked operation failed (exit {os.waitstatus_to_exitcode(status)})")
    return killed


def ops(events: str) -> int:
    return sum(1 for e in bnd.events(events) if e[0] == "op")


def killed_midway(rng: random.Random, run: str, scratch: str, fn_for) -> tuple[bool, int]:
    """Run ``fn_for(dir)`` once on a copy of ``run`` to count its operations, then on ``run`` killed at one drawn
    from that count."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(run, scratch)
    forked(lambda: fn_for(scratch), scratch + ".events", None)
    count = ops(scratch + ".events")
    at = rng.randrange(count) if count else None
    return forked(lambda: fn_for(run), run + ".events", at), count


def main() -> None:
    root, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    run, scratch = os.path.join(root, "run"), os.path.join(root, "scratch")
    states = reference_states()
    out: dict = {"events": [], "failures": []}
    for step in range(1, STEPS + 1):
        killed, count = killed_midway(rng, run if os.path.exists(run) else _empty(run), scratch,
                                      lambda d, s=step: save(d, states, s))
        out["events"].append(f"save {step}: {count} operations, killed={killed}")
        out["failures"] += [f"after killed save {step}: {w}" for w in judge(run, states, step - 1, or_next=True)]
        save(run, states, step)  # the restart
        out["failures"] += [f"after save {step}: {w}" for w in judge(run, states, step)]
        _collect(rng, run, scratch, states, step, out)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run) for f in fs)
    full = _full_bytes(root, states)
    out.update(bytes_on_disk=total, ten_full_saves=full, ratio=total / full)
    print(json.dumps(out))


def _empty(run: str) -> str:
    os.makedirs(run, exist_ok=True)
    return run


def _collect(rng: random.Random, run: str, scratch: str, states: list[dict], step: int, out: dict) -> None:
    committed = sorted(int(n.split("-")[1]) for n in os.listdir(run)
                       if n.startswith("step-") and os.path.exists(os.path.join(run, n, "manifest.json")))
    if rng.random() < 0.3 and len(committed) > 1:
        victim = rng.choice(committed[:-1])
        if rng.random() < 0.3:
            killed, _ = killed_midway(rng, run, scratch, lambda d, v=victim: pool_gc.rm(step_path(d, v)))
        else:
            pool_gc.rm(step_path(run, victim))
            killed = False
        out["events"].append(f"rm step {victim}, killed={killed}")
        out["failures"] += [f"after rm {victim}: {w}" for w in judge(run, states, step)]
    killed, count = killed_midway(rng, run, scratch, lambda d: gc(d))
    out["events"].append(f"gc: {count} operations, killed={killed}")
    out["failures"] += [f"after killed gc ({step}): {w}" for w in judge(run, states, step)]
    gc(run)
    out["failures"] += [f"after gc ({step}): {w}" for w in judge(run, states, step)]


def _full_bytes(root: str, states: list[dict]) -> int:
    """The bytes of ten full (non-incremental) saves of the same states."""
    full = os.path.join(root, "full")
    total = 0
    for step, sd in enumerate(states, 1):
        shardckpt.save(sd, step_path(full, step))
    for d, _, fs in os.walk(full):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in fs)
    return total


if __name__ == "__main__":
    main()
