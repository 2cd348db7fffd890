"""The demo's settings, importable without torch (the CLI reads its defaults when building ``--help``)."""
from __future__ import annotations

import dataclasses
import os


class DemoError(Exception):
    """A stage of the demo failed; the message names the stage and where its log is."""


class DemoUsageError(DemoError):
    """The demo cannot start with these settings (an unusable ``--out``, steps that do not fit): a usage error."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    dim: int = 256
    heads: int = 4


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    out: str = os.path.join("runs", "demo")
    steps: int = 240
    save_every: int = 20
    crash_at: int = 140  # the step whose save is in flight when the ranks are killed
    first_world_size: int = 2
    resumed_world_size: int = 3
    shape: ModelShape = ModelShape()

    def check(self) -> None:
        if not 0 < self.save_every < self.crash_at < self.steps:
            raise DemoUsageError(f"need 0 < save_every ({self.save_every}) < crash_at ({self.crash_at}) < steps ({self.steps})")
        if self.crash_at % self.save_every:
            raise DemoUsageError(f"crash_at ({self.crash_at}) must be a save step: a multiple of save_every ({self.save_every})")


@dataclasses.dataclass(frozen=True)
class TiersDemoConfig:
    """``shardckpt demo --tiers``: 4 ranks as 2 nodes, then node 0's 2 ranks after node 1 is lost."""

    out: str = os.path.join("runs", "demo-tiers")
    steps: int = 160
    save_every: int = 10  # tier 0, replicated
    persistent_every: int = 40  # tier 2
    crash_at: int = 110  # the kill comes once a step at or after this one is replicated
    world_size: int = 4
    resumed_world_size: int = 2
    shape: ModelShape = ModelShape()

    def check(self) -> None:
        if not 0 < self.save_every < self.crash_at < self.steps:
            raise DemoUsageError(f"need 0 < save_every ({self.save_every}) < crash_at ({self.crash_at}) < steps ({self.steps})")
        if self.persistent_every % self.save_every or self.persistent_every <= 0:
            raise DemoUsageError(f"persistent_every ({self.persistent_every}) must be a positive multiple of save_every "
                                 f"({self.save_every}): tier 2 is uploaded from tier 0's copy")
        if self.persistent_every > self.crash_at:
            raise DemoUsageError(f"persistent_every ({self.persistent_every}) must not exceed crash_at ({self.crash_at}): "
                                 "the demo compares the fast tiers with tier 2's newest step")
        first = -(-self.crash_at // self.save_every) * self.save_every  # the first save at or after crash_at
        if first + 2 * self.save_every > self.steps:  # replicated (latest wins: maybe the next), 2 steps trained
            raise DemoUsageError(f"steps ({self.steps}) must leave two saves after crash_at ({self.crash_at}): the kill "
                                 f"comes once a save from step {first} on is replicated and two more steps are "
                                 f"trained; use --steps {first + 2 * self.save_every} or more")
