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
