"""Checkpoint tiers (issue 40, docs/design/tiers.md): a node-local copy of every step (tier 0), replicas of each
node's files on ``k`` peer nodes (tier 1), and the persistent store written from tier 0 (tier 2).

So far only the pure core is here, no I/O and no torch: ``config`` (``TierConfig``, the frozen settings),
``peers`` (which nodes hold each node's replicas), ``budget`` (what tier 0 may hold, and what to evict or refuse)
and ``restore`` (given what every node holds, the step all ranks restore and where each reads each file from).
"""
