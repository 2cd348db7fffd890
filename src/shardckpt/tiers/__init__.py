"""Checkpoint tiers (issue 40, docs/design/tiers.md): a node-local copy of every step (tier 0), replicas of each
node's files on ``k`` peer nodes (tier 1), and the persistent store written from tier 0 (tier 2).

The pure core, no I/O and no torch: ``config`` (``TierConfig``, the frozen settings), ``peers`` (which nodes hold
each node's replicas), ``budget`` (what tier 0 may hold, and what to evict or refuse) and ``restore`` (given what
every node holds, the step all ranks restore and where each reads each file from). Around it: ``local`` (a node's
tier-0 directory), ``peer`` (the read-only peer server and ``PeerStorage``), ``copy`` (checked copies between
tiers), ``tiered`` (a restore's per-file routed ``Storage``), ``topology`` (the node map), ``lanes`` (the
background writes, replication and uploads), ``restore_io`` (the restore protocol) and ``manager``
(``CheckpointManager``, imported lazily: it needs torch).
"""

from shardckpt.tiers.config import TierConfig, TierConfigError

__all__ = ["TierConfig", "TierConfigError", "CheckpointManager", "TierSave", "Restored", "RestoreError"]


def __getattr__(name: str):
    if name in ("CheckpointManager", "TierSave"):
        from shardckpt.tiers import manager
        return getattr(manager, name)
    if name in ("Restored", "RestoreError"):
        from shardckpt.tiers import restore_io
        return getattr(restore_io, name)
    raise AttributeError(name)
