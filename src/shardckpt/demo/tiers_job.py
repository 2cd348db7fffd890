"""``shardckpt demo --tiers``: a node lost, training resumed from a peer's replica (``shardckpt.tiers``).

1. train ``DemoTransformer`` on 4 gloo ranks as 2 simulated nodes of 2 ranks, each node with its own tier-0
   directory: every K steps a tier-0 save, replicated to the other node; every M steps an upload to tier 2;
2. SIGKILL every rank once step ``crash_at`` is replicated, and delete node 1's tier 0: the node is gone;
3. from the directories alone, work out the step a restart must restore: the newest with every file whole on the
   surviving node (its own copies and node 1's replicas) or committed in tier 2;
4. ``shardckpt verify`` the surviving node's copy of that step and every tier-2 checkpoint;
5. restart on node 0's 2 ranks: they restore that step (node 1's shards from the replicas, every byte checked
   against its checksums) and train to the end; the losses must continue the killed run's;
6. flip one byte of node 0's copy of its newest step, and restart on 4 ranks with node 1 back, empty (its ranks
   read node 0's files through its peer server): the corrupt copy must be excluded, never loaded, and the
   restore fall back to the newest step that still has a good copy of every file (tier 2's, or an older one);
7. write ``loss.png`` (the resume marked with the tiers it read from) and ``summary.json``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable

from shardckpt.demo.config import DemoError, TiersDemoConfig
from shardckpt.demo.job import Check, _by_step, _loss_continuity, _prepare, _Run
from shardckpt.demo.processes import EventTail, TrainingRanks, run_command
from shardckpt.demo.report import plot_tier_losses, tier_summary_lines
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.tiers.local import step_dir

RUN_ID = "demo"  # train.tier_config's


@dataclasses.dataclass
class _Places:
    out: str

    @property
    def tiers(self) -> str:
        return os.path.join(self.out, "tiers")

    def node(self, n: int) -> str:
        """Node ``n``'s tier-0 directory of the run (its ``step-*`` directories)."""
        return os.path.join(self.tiers, "nodes", f"node-{n}", RUN_ID)

    @property
    def persistent(self) -> str:
        return os.path.join(self.tiers, "persistent")

    def log(self, name: str) -> str:
        return os.path.join(self.out, "logs", name)


def run_tiers_demo(config: TiersDemoConfig = TiersDemoConfig(), say: Callable[[str], None] = print) -> dict:
    """Run the tiers variant of the main job; returns the summary (also ``OUT/summary.json``). Raises
    ``DemoError`` when a stage cannot go on; failed checks are reported (``checksums_equal`` false)."""
    config.check()
    t0 = time.perf_counter()
    places = _Places(_prepare(config.out))
    say(f"1. training a {config.shape.layers}-layer transformer on {config.world_size} ranks as 2 nodes; tier 0 "
        f"every {config.save_every} steps (replicated to the other node), tier 2 every {config.persistent_every}")
    first = _train_until_replicated(config, places)
    shutil.rmtree(os.path.dirname(places.node(1)))
    fast, persistent = _complete_steps([places.node(0)]), _complete_steps([], places.persistent)
    expected = max(fast | persistent, default=None)
    if expected is None:
        raise DemoError(f"no complete step survived the loss of node 1 (under {places.tiers})")
    say(f"2. kill -9 of all {config.world_size} ranks at step {first['killed_at']}; node 1 lost with its tier 0. "
        f"Newest complete step: {expected} (tier 2 alone: {max(persistent, default='none')})")
    checks = _verified(places, expected if expected in fast else None, persistent)
    say(f"3. shardckpt verify of the surviving copies (node 0's of step {expected if expected in fast else '-'}, "
        f"{len(persistent)} in tier 2): {'OK' if all(c.ok for c in checks) else 'FAILED'}")
    resumed = _resume(config, places, config.resumed_world_size, config.steps, "resumed")
    restored = resumed["restored"]
    checks.append(Check("the restart restored the newest complete step", restored.get("step") == expected,
                        f"restored step {restored.get('step')}, expected {expected}"))
    checks.append(Check("node 1's shards came from the replicas", restored.get("tiers", {}).get("tier1", 0) > 0,
                        f"bytes read by tier: {restored.get('tiers')}"))
    continuity = _loss_continuity(first["losses"], resumed["losses"])
    checks.append(Check("resumed losses continue the killed run's", continuity["ok"],
                        f"largest difference {continuity['max_abs_difference']:.2e} over {continuity['steps']} steps"))
    say(f"4. restarted on node 0's {config.resumed_world_size} ranks: restored step {restored.get('step')} in "
        f"{restored.get('seconds', 0):.2f} s (bytes by tier: {restored.get('tiers')}), trained to step {config.steps}")
    regrow, regrown_checks, regrown = _corrupt_and_regrow(config, places, resumed["losses"])
    checks += regrown_checks
    say(f"5. flipped a byte of {regrow['corrupted']}; restarted on {config.world_size} ranks (node 1 back, empty): "
        f"restored step {regrow['from_step']} ({regrow['copies_excluded']} copy excluded; bytes by tier: "
        f"{regrow['bytes_by_tier']}), trained to step {regrow['steps']}")
    summary = {
        "out": places.out, "variant": "tiers", "steps": config.steps, "save_every": config.save_every,
        "persistent_every": config.persistent_every, "world_sizes": [config.world_size, config.resumed_world_size],
        "model": {"parameters": first["parameters"], **dataclasses.asdict(config.shape)},
        "crash": {"step": first["killed_at"], "signal": "SIGKILL", "node_lost": "node-1"},
        "resume": {"from_step": restored.get("step"), "expected_step": expected,
                   "tier2_newest_step": max(persistent, default=None),
                   "steps_saved_over_tier2": expected - max(persistent, default=0),
                   "bytes_by_tier": restored.get("tiers"), "slowest_tier": restored.get("slowest"),
                   "seconds": restored.get("seconds"), "copies_excluded": restored.get("excluded"), **continuity},
        "saves": _tier_saves(first["saves"]),
        "regrow": regrow,
        "losses": {"first": _by_step(first["losses"]), "resumed": _by_step(resumed["losses"]),
                   "regrown": _by_step(regrown)},
        "checks": [dataclasses.asdict(c) for c in checks],
        "checksums_equal": all(c.ok for c in checks),
    }
    summary["loss_png"] = plot_tier_losses(summary, os.path.join(places.out, "loss.png"))
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(places.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    for line in tier_summary_lines(summary):
        say(line)
    return summary


def _train_args(config: TiersDemoConfig, places: _Places, events: str, steps: int) -> list[str]:
    shape = config.shape
    return ["--steps", str(steps), "--save-every", str(config.save_every), "--checkpoints", places.tiers,
            "--tiers", places.tiers, "--persistent-every", str(config.persistent_every), "--ranks-per-node", "2",
            "--layers", str(shape.layers), "--dim", str(shape.dim), "--heads", str(shape.heads), "--events", events]


def _train_until_replicated(config: TiersDemoConfig, places: _Places) -> dict:
    """Train on 4 ranks until a step at or after ``crash_at`` is replicated and two more steps are trained (which
    the resumed run trains again: the losses of both must agree), then SIGKILL them all."""
    events = os.path.join(places.out, "events-first.jsonl")
    run = _TierRun(TrainingRanks(config.world_size, _train_args(config, places, events, config.steps),
                                 os.path.join(places.out, "logs"), "first"), EventTail(events))
    run.follow(until=lambda e: e["event"] == "tier_saved" and e["tier"] == "tier1" and e["step"] >= config.crash_at,
               what=f"replicate a step at or after step {config.crash_at}")
    replicated = max(s["step"] for s in run.saves if s["event"] == "tier_saved" and s["tier"] == "tier1")
    run.follow(until=lambda e: e["event"] == "loss" and e["step"] >= replicated + 1,
               what=f"train two steps past step {replicated}")
    run.ranks.kill()
    run.take(run.tail.new())
    return {**run.result(), "killed_at": max(run.losses) + 1}


def _resume(config: TiersDemoConfig, places: _Places, world: int, steps: int, tag: str) -> dict:
    """Restart on ``world`` ranks: restore from the tiers, train to ``steps``."""
    events = os.path.join(places.out, f"events-{tag}.jsonl")
    run = _TierRun(TrainingRanks(world, _train_args(config, places, events, steps), os.path.join(places.out, "logs"),
                                 tag), EventTail(events))
    run.follow(until=None, what=f"restore and train to step {steps}")
    return {**run.result(), "restored": run.restored}


def _corrupt_and_regrow(config: TiersDemoConfig, places: _Places, resumed: dict) -> tuple[dict, list[Check], dict]:
    """Stage 6: one byte of node 0's newest step flipped, then a restart on every rank with node 1 back, empty.
    Returns the stage's summary, its checks and the regrown run's losses."""
    newest = max(_complete_steps([places.node(0)]))
    victim = _flip_a_byte(os.path.join(places.node(0), step_dir(newest)))
    expected = max(_complete_steps([places.node(0)], places.persistent, bad={victim}))
    steps = config.steps + 2 * config.save_every
    regrown = _resume(config, places, config.world_size, steps, "regrown")
    restored = regrown["restored"]
    checks = [Check("the corrupt copy was excluded and the restore fell back to a good one",
                    restored.get("step") == expected and restored.get("excluded", 0) >= 1,
                    f"restored step {restored.get('step')} (expected {expected}), {restored.get('excluded')} copy "
                    f"excluded, bytes read by tier: {restored.get('tiers')}")]
    continuity = _loss_continuity(resumed, regrown["losses"])
    if continuity["steps"]:  # it restored an older step than the resumed run's last: the steps both trained agree
        checks.append(Check("regrown losses continue the resumed run's", continuity["ok"],
                            f"largest difference {continuity['max_abs_difference']:.2e} over {continuity['steps']} "
                            "steps"))
    summary = {"corrupted": os.path.relpath(victim, places.tiers), "from_step": restored.get("step"),
               "expected_step": expected, "copies_excluded": restored.get("excluded"),
               "bytes_by_tier": restored.get("tiers"), "seconds": restored.get("seconds"), "steps": steps,
               "world_size": config.world_size}
    return summary, checks, regrown["losses"]


def _flip_a_byte(step: str) -> str:
    """Flip one byte in the middle of the first data file of checkpoint directory ``step``; returns its path."""
    manifest_path = os.path.join(step, MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        path = os.path.join(step, parse_manifest(f.read(), manifest_path).files[0].path)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    return path


class _TierRun(_Run):
    """``job._Run``, also keeping the restore's event and each tier's landings."""

    def __init__(self, ranks: TrainingRanks, tail: EventTail) -> None:
        super().__init__(ranks, tail)
        self.restored: dict = {}

    def take(self, events: list[dict]) -> None:
        super().take(events)
        for e in events:
            if e["event"] == "restored":
                self.restored = e
            elif e["event"] == "tier_saved":
                self.saves.append(e)


def _complete_steps(dirs: list[str], persistent: str | None = None, bad: frozenset[str] = frozenset()) -> set[int]:
    """The steps with every file of their manifest present at its size in one of ``dirs`` (a copy in ``bad`` not
    counted), or (``persistent``) committed there: what a restart may restore, judged from the directories alone."""
    out = set()
    for d in (d for d in dirs if os.path.isdir(d)):
        for name in (n for n in os.listdir(d) if n.startswith("step-")):
            manifest_path = os.path.join(d, name, MANIFEST_NAME)
            if not os.path.exists(manifest_path):
                continue
            with open(manifest_path, "rb") as f:
                manifest = parse_manifest(f.read(), manifest_path)
            if all(any(_sized(p, f.size) and p not in bad for p in (os.path.join(e, name, f.path) for e in dirs))
                   for f in manifest.files):
                out.add(int(name.split("-")[1]))
    if persistent and os.path.isdir(persistent):
        out |= {int(n.split("-")[1]) for n in os.listdir(persistent)
                if n.startswith("step-") and os.path.exists(os.path.join(persistent, n, MANIFEST_NAME))}
    return out


def _sized(path: str, size: int) -> bool:
    return os.path.exists(path) and os.path.getsize(path) == size


def _verified(places: _Places, fast_step: int | None, persistent: set[int]) -> list[Check]:
    """``shardckpt verify`` of the surviving node's copy of ``fast_step`` (None: the restored step was tier 2's)
    and of each tier-2 step."""
    paths = [os.path.join(places.node(0), step_dir(fast_step))] if fast_step is not None else []
    paths += [os.path.join(places.persistent, step_dir(s)) for s in sorted(persistent)]
    checks = []
    for path in paths:
        name = os.path.relpath(path, places.tiers)
        result = run_command("verify", path, log=places.log(f"verify-{name.replace(os.sep, '-')}.log"))
        checks.append(Check(f"verify {name}", result.returncode == 0, result.output.strip()))
    return checks


def _tier_saves(events: list[dict]) -> dict:
    started = [e for e in events if e["event"] == "save_started"]
    landed = {tier: sorted(e["step"] for e in events if e["event"] == "tier_saved" and e["tier"] == tier)
              for tier in ("tier0", "tier1", "tier2")}
    blocked = sorted(e["blocked_s"] for e in started)
    return {"count": len(started), "steps_by_tier": landed,
            "training_blocked_s_median": round(blocked[len(blocked) // 2], 4) if blocked else None,
            "training_blocked_s_total": round(sum(blocked), 4)}

