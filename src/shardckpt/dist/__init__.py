"""Process groups and object collectives over torch.distributed (or a world of one), and carrying a rank's
failure to every rank so that all raise together instead of hanging. Layers above use this package for
their object collectives; the runtime's tensor collectives are the remaining direct torch.distributed user."""
from __future__ import annotations

from shardckpt.dist.group import LOCAL, Failure, Group, attempt, raise_failures, resolve_group

__all__ = ["LOCAL", "Failure", "Group", "attempt", "raise_failures", "resolve_group"]
