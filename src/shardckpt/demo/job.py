"""``shardckpt demo``, the main job: the whole life of a sharded training run's checkpoints, on this machine.

1. train ``DemoTransformer`` on 2 gloo ranks with the runtime, saving asynchronously every K steps;
2. SIGKILL both ranks while a save is in flight;
3. find the last committed checkpoint, ``verify`` it, and ``gc`` what the killed save left;
4. ``convert`` it offline to 3 ranks, and ``diff`` the result against it;
5. resume on 3 ranks from the converted checkpoint and train to the end;
6. ``export`` bf16 safetensors from the final checkpoint, ``verify --against`` it, and compare the
   exported tensors with the final in-memory weights cast to bf16;
7. write ``loss.png`` and ``summary.json``.

Every check is recorded in the summary; ``checksums_equal`` is true only when all of them passed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import statistics
import time
from typing import Callable

import torch

from shardckpt.checkpoint.latest import latest_checkpoint
from shardckpt.demo.config import DemoConfig, DemoError, DemoUsageError
from shardckpt.demo.processes import CommandResult, EventTail, TrainingRanks, checked_command, run_command
from shardckpt.demo.report import plot_losses, summary_lines
from shardckpt.demo.train import checkpoint_path
from shardckpt.format.manifest import MANIFEST_NAME

# What the demo writes under --out: a directory holding anything else is refused rather than cleared.
OWN_NAMES = {"checkpoints", "export", "logs", "events-first.jsonl", "events-resumed.jsonl", "final-weights.pt",
             "loss.png", "summary.json", "tiers", "events-regrown.jsonl",  # tiers: ``demo --tiers`` (demo/tiers_job.py)
             ".shardckpt-demo"}
MARK = ".shardckpt-demo"  # written first into --out: only a directory that has it is cleared for a rerun
TIME_LIMIT_S = 1800.0  # a hung rank must not hang the demo


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclasses.dataclass
class _Demo:
    """One demo's places, its checks so far, and where it reports."""

    config: DemoConfig
    out: str
    say: Callable[[str], None]
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def ckpts(self) -> str:
        return os.path.join(self.out, "checkpoints")

    def log(self, name: str) -> str:
        return os.path.join(self.out, "logs", name)

    def train_args(self, events: str) -> list[str]:
        shape = self.config.shape
        return ["--steps", str(self.config.steps), "--save-every", str(self.config.save_every), "--checkpoints",
                self.ckpts, "--layers", str(shape.layers), "--dim", str(shape.dim), "--heads", str(shape.heads),
                "--events", events]


def run_demo(config: DemoConfig = DemoConfig(), say: Callable[[str], None] = print) -> dict:
    """Run the main job; returns the summary (also written to ``OUT/summary.json``). Raises ``DemoError``
    when a stage cannot go on; failed checks are reported in the summary (``checksums_equal`` false)."""
    config.check()
    t0 = time.perf_counter()
    demo = _Demo(config, _prepare(config.out), say)
    first, killed = _first_run(demo)
    resume_from, resume_step, debris = _last_committed(demo, killed)
    converted, convert = _convert(demo, resume_from)
    resumed, continuity, final_weights = _resumed_run(demo, converted, first, resume_step)
    exported, export = _export(demo, final_weights)
    files = sorted(os.listdir(exported))
    summary = {
        "out": demo.out,
        "model": {"parameters": first["parameters"], **dataclasses.asdict(config.shape)},
        "steps": config.steps,
        "save_every": config.save_every,
        "world_sizes": [config.first_world_size, config.resumed_world_size],
        "crash": {"step": killed["step"], "signal": "SIGKILL", "save_in_flight": killed["in_flight"],
                  "bytes_on_disk_at_kill": killed["bytes_on_disk_at_kill"],
                  "last_committed_step": resume_step, "steps_lost": max(first["losses"]) + 1 - resume_step,
                  "debris_removed_by_gc": debris},
        "checkpoints": [_checkpoint_entry(path) for path in _committed(demo.ckpts)],
        "saves": _save_stats(first["saves"] + resumed["saves"]),
        "convert": {"src": resume_from, "dst": converted, "world_size": config.resumed_world_size, "type": "local",
                    "seconds": round(convert.seconds, 3), "peak_rss_mib": round(convert.peak_rss_bytes / 2**20, 1)},
        "resume": {"world_size": config.resumed_world_size, "from_step": resume_step, **continuity},
        "export": {"dir": exported, "dtype": "bfloat16", "files": files,
                   "bytes": sum(os.path.getsize(os.path.join(exported, f)) for f in files),
                   "seconds": round(export.seconds, 3)},
        "losses": {"first": _by_step(first["losses"]), "resumed": _by_step(resumed["losses"])},
        "checks": [dataclasses.asdict(c) for c in demo.checks],
        "checksums_equal": all(c.ok for c in demo.checks),
    }
    summary["loss_png"] = plot_losses(summary, os.path.join(demo.out, "loss.png"))
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(demo.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    for line in summary_lines(summary):
        say(line)
    return summary


def _first_run(demo: _Demo) -> tuple[dict, dict]:
    """Step 1 and 2: train on the first world size until the kill lands mid-save."""
    config = demo.config
    demo.say(f"1. training a {config.shape.layers}-layer transformer on {config.first_world_size} ranks (FULL_SHARD, "
            f"gloo), async save every {config.save_every} steps into {demo.ckpts}")
    events = os.path.join(demo.out, "events-first.jsonl")
    first, killed = _train_until_killed(config, demo.train_args(events), events, os.path.join(demo.out, "logs"),
                                        demo.ckpts)
    when = (f"while its save was being written ({killed['bytes_on_disk_at_kill'] / 2**20:.1f} MiB on disk)"
            if killed["in_flight"] else "just after its save committed")
    demo.say(f"2. kill -9 of both ranks at step {killed['step']}, {when}")
    return first, killed


def _last_committed(demo: _Demo, killed: dict) -> tuple[str, int, list[str]]:
    """Step 3: the checkpoint a restarted job would pick, verified; what the killed save left, collected."""
    resume_from = latest_checkpoint(demo.ckpts)
    if resume_from is None:
        raise DemoError(f"no committed checkpoint in {demo.ckpts}")
    resume_step = int(os.path.basename(resume_from).split("-")[1])
    verified = run_command("verify", resume_from, log=demo.log("verify-last.log"))
    demo.checks.append(Check("verify last committed checkpoint", verified.returncode == 0, verified.output.strip()))
    debris = _collect_debris(checkpoint_path(demo.ckpts, killed["step"]), demo.log("gc.log"))
    demo.say(f"3. last committed checkpoint: step {resume_step} (verify: "
            f"{'OK' if verified.returncode == 0 else 'FAILED'}); gc removed {len(debris)} uncommitted "
            f"entr{'y' if len(debris) == 1 else 'ies'} the killed save left")
    return resume_from, resume_step, debris


def _convert(demo: _Demo, resume_from: str) -> tuple[str, CommandResult]:
    """Step 4: the checkpoint converted offline to the resumed world size, diffed against its source."""
    size = demo.config.resumed_world_size
    converted = f"{resume_from}-ws{size}"
    convert = checked_command("convert", resume_from, converted, "--world-size", str(size), "--type", "local",
                              "--quiet", log=demo.log("convert.log"))
    diff = run_command("diff", resume_from, converted, log=demo.log("diff.log"))
    demo.checks.append(Check("converted checkpoint equals its source", diff.returncode == 0, diff.output.strip()))
    demo.say(f"4. shardckpt convert to {size} ranks (LOCAL): {convert.seconds:.1f} s, peak memory "
            f"{convert.peak_rss_bytes / 2**20:.0f} MiB; diff against the source: "
            f"{'equal' if diff.returncode == 0 else 'DIFFERENT'}")
    return converted, convert


def _resumed_run(demo: _Demo, converted: str, first: dict, resume_step: int) -> tuple[dict, dict, str]:
    """Step 5: resume from the converted checkpoint and train to the end; the steps both runs trained agree."""
    config = demo.config
    events, final_weights = os.path.join(demo.out, "events-resumed.jsonl"), os.path.join(demo.out, "final-weights.pt")
    resumed = _train_to_end(config, demo.train_args(events) + ["--resume", converted, "--final-weights",
                                                              final_weights], events, os.path.join(demo.out, "logs"))
    continuity = _loss_continuity(first["losses"], resumed["losses"])
    demo.checks.append(Check("resumed losses continue the killed run's", continuity["ok"],
                            f"largest difference {continuity['max_abs_difference']:.2e} over {continuity['steps']} "
                            f"steps both runs trained (tolerance {continuity['tolerance']:.0e})"))
    demo.say(f"5. resumed on {config.resumed_world_size} ranks from step {resume_step}, trained to step "
            f"{config.steps}: loss {resumed['losses'][resume_step]:.3f} -> {resumed['losses'][config.steps - 1]:.3f};"
            f" the {continuity['steps']} steps both runs trained differ by at most "
            f"{continuity['max_abs_difference']:.1e}")
    return resumed, continuity, final_weights


def _export(demo: _Demo, final_weights: str) -> tuple[str, CommandResult]:
    """Step 6: bf16 safetensors of the final checkpoint, verified against it and against the final weights."""
    final, exported = checkpoint_path(demo.ckpts, demo.config.steps), os.path.join(demo.out, "export")
    export = checked_command("export", final, exported, "--dtype", "bfloat16", "--quiet", log=demo.log("export.log"))
    against = run_command("verify", exported, "--against", final, log=demo.log("verify-export.log"))
    demo.checks.append(Check("export verified against the final checkpoint", against.returncode == 0,
                            against.output.strip()))
    demo.checks.append(_export_equals_weights(exported, final_weights))
    demo.say(f"6. shardckpt export --dtype bfloat16: {', '.join(sorted(os.listdir(exported)))} in "
            f"{export.seconds:.1f} s; verify --against: {'OK' if against.returncode == 0 else 'FAILED'}; "
            f"{demo.checks[-1].detail}")
    return exported, export


def _prepare(out: str) -> str:
    """Create ``out``, or clear what an earlier demo wrote there; refuse a directory holding anything else,
    and a file (``DemoUsageError``, one line)."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise DemoUsageError(f"{out} is a file, not a directory; choose another --out")
    if os.path.isdir(out):
        foreign = sorted(set(os.listdir(out)) - OWN_NAMES)
        if foreign:
            raise DemoUsageError(f"{out} holds files the demo did not write ({', '.join(foreign[:5])}); "
                                 f"choose another --out or empty it")
        if os.listdir(out) and not os.path.exists(os.path.join(out, MARK)):  # names like ours, but not ours
            raise DemoUsageError(f"{out} holds {', '.join(sorted(os.listdir(out))[:5])}, not written by shardckpt "
                                 f"demo (no {MARK} there); choose another --out or empty it")
        for name in os.listdir(out):
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    try:
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
        open(os.path.join(out, MARK), "w").close()
    except OSError as e:  # a file above it, no permission: say so plainly, not as a raw [Errno N]
        raise DemoUsageError(f"cannot create {out}: {e.strerror.lower() if e.strerror else e}; "
                             f"choose another --out") from e
    return out


def _train_until_killed(config: DemoConfig, train_args: list[str], events: str, logs: str, ckpts: str) -> tuple[dict, dict]:
    """Train on the first world size; SIGKILL every rank while the save of step ``crash_at`` is being written:
    once rank 0 says it started and its first data bytes are on disk. A save that commits before the kill
    could land (a small one, a slow poll) moves the kill to the next save."""
    run = _Run(TrainingRanks(config.first_world_size, train_args, logs, "first"), EventTail(events))
    step = config.crash_at
    while True:
        run.follow(until=lambda e: e["event"] == "save_started" and e["step"] == step,
                   what=f"catch a save in flight at or after step {config.crash_at}")
        dying = checkpoint_path(ckpts, step)
        run.follow(until=lambda e: e["event"] == "save_committed", what=f"write the save of step {step}",
                   ready=functools.partial(_being_written, dying))
        if _being_written(dying):
            break
        step += config.save_every
    run.ranks.kill()
    run.take(run.tail.new())  # lines written between the decision and the kill
    committed = os.path.exists(os.path.join(dying, MANIFEST_NAME))
    return run.result(), {"step": step, "in_flight": not committed, "bytes_on_disk_at_kill": _data_bytes(dying)}


def _being_written(path: str) -> bool:
    return _data_bytes(path) > 0 and not os.path.exists(os.path.join(path, MANIFEST_NAME))


def _data_bytes(path: str) -> int:
    """Bytes of data files under ``path`` (the manifest excluded)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if f != MANIFEST_NAME) if os.path.isdir(path) else 0


def _train_to_end(config: DemoConfig, train_args: list[str], events: str, logs: str) -> dict:
    run = _Run(TrainingRanks(config.resumed_world_size, train_args, logs, "resumed"), EventTail(events))
    run.follow(until=None, what=f"train to step {config.steps}")
    return run.result()


class _Run:
    """One training phase as its events tell it: losses by step, saves, the parameter count."""

    def __init__(self, ranks: TrainingRanks, tail: EventTail) -> None:
        self.ranks, self.tail = ranks, tail
        self.losses: dict[int, float] = {}
        self.saves: list[dict] = []
        self.parameters = 0

    def follow(self, until: Callable[[dict], bool] | None, what: str, ready: Callable[[], bool] = lambda: False) -> None:
        """Read events until ``until`` says so or ``ready()`` is true, or (``until`` None) every rank exited 0."""
        deadline = time.monotonic() + TIME_LIMIT_S
        while time.monotonic() < deadline:
            if ready():
                return
            events = self.tail.new()
            self.take(events)  # the whole batch: an event after the one ``until`` waits for is kept, not dropped
            if until is not None and any(until(e) for e in events):
                return
            if self.ranks.check():
                self.take(self.tail.new())
                if until is None:
                    return
                raise DemoError(f"training ended without being able to {what}")
            time.sleep(0.001)
        self.ranks.kill()
        raise DemoError(f"training did not {what} within {TIME_LIMIT_S:.0f} s (logs: {self.ranks.logs})")

    def take(self, events: list[dict]) -> None:
        for e in events:
            if e["event"] == "loss":
                self.losses[e["step"]] = e["loss"]
            elif e["event"] in ("save_started", "save_committed"):
                self.saves.append(e)
            elif e["event"] == "started":
                self.parameters = e.get("parameters", 0)

    def result(self) -> dict:
        return {"losses": self.losses, "saves": self.saves, "parameters": self.parameters}


def _collect_debris(path: str, log: str) -> list[str]:
    """``shardckpt gc`` the killed save's directory: what it removed (nothing if the kill came before any file)."""
    if not os.path.isdir(path):
        return []
    removed = checked_command("gc", path, log=log)
    return [line.split(" ", 1)[1] for line in removed.output.splitlines() if line.startswith("removed ")]


def _committed(ckpts: str) -> list[str]:
    """The committed checkpoints under ``ckpts`` (a manifest is written last: its presence is the commit)."""
    return sorted(os.path.join(ckpts, name) for name in os.listdir(ckpts)
                  if os.path.exists(os.path.join(ckpts, name, MANIFEST_NAME)))


def _loss_continuity(first: dict[int, float], resumed: dict[int, float], tolerance: float = 2e-3) -> dict:
    """The resumed run trains again the steps between its checkpoint and the kill, on the same batches: its
    losses there must match the killed run's up to the summation order of another world size."""
    both = sorted(set(first) & set(resumed))
    worst = max((abs(first[s] - resumed[s]) for s in both), default=float("inf"))
    return {"steps": len(both), "max_abs_difference": worst, "tolerance": tolerance,
            "ok": bool(both) and worst <= tolerance}


def _export_equals_weights(exported: str, final_weights: str) -> Check:
    """Every exported tensor equals the final in-memory weight of that name cast to bf16, and every weight is
    exported (a tied weight once, under one of its names)."""
    from safetensors import safe_open

    weights = torch.load(final_weights, weights_only=True)
    seen, bad = set(), []
    for name in sorted(f for f in os.listdir(exported) if f.endswith(".safetensors")):
        with safe_open(os.path.join(exported, name), "pt") as f:
            for key in f.keys():
                seen.add(key)
                if key not in weights or not torch.equal(f.get_tensor(key), weights[key].to(torch.bfloat16)):
                    bad.append(key)
    aliases = {k for k in weights if k not in seen and any(weights[k] is weights[s] or torch.equal(weights[k], weights[s])
                                                           for s in seen)}
    missing = sorted(set(weights) - seen - aliases)
    ok = not bad and not missing
    detail = (f"all {len(seen)} exported tensors equal the final weights cast to bf16" + (f" ({len(aliases)} tied alias "
              f"written once)" if aliases else "")) if ok else f"differ: {bad[:5]}, missing: {missing[:5]}"
    return Check("exported tensors equal the final weights in bf16", ok, detail)


def _checkpoint_entry(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
        world_size = json.load(f).get("world_size")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    name = os.path.basename(path)  # step-000120, or step-000120-ws3 for the converted one
    return {"path": path, "step": int(name.split("-")[1]), "world_size": world_size, "bytes": size}


def _save_stats(events: list[dict]) -> dict:
    started = [e for e in events if e["event"] == "save_started"]
    committed = [e for e in events if e["event"] == "save_committed"]
    blocked = [e["blocked_s"] + e["waited_s"] for e in started]
    return {"count": len(started), "committed": len(committed),
            "training_blocked_s_total": round(sum(blocked), 4),
            "training_blocked_s_median": round(statistics.median(blocked), 4) if blocked else None,
            "committed_within_s_median": round(statistics.median(e["within_s"] for e in committed), 4) if committed else None}


def _by_step(losses: dict[int, float]) -> list[list]:
    return [[step, round(loss, 6)] for step, loss in sorted(losses.items())]
