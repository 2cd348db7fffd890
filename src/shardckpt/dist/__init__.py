"""shardckpt's dist layer, the only package that talks to torch.distributed (or acts as a world of one):
process groups and object collectives, and carrying a rank's failure to every rank so that all raise together
instead of hanging (group.py); the tensor collectives and process-group queries the sharding runtime and the
state-dict layer use (collectives.py); joining a gloo world from spawned processes (world.py)."""
from __future__ import annotations

from shardckpt.dist.group import LOCAL, Failure, Group, attempt, raise_failures, resolve_group

__all__ = ["LOCAL", "Failure", "Group", "attempt", "raise_failures", "resolve_group"]
