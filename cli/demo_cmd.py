"""``shardckpt demo``: the main job on built-in defaults (see ``shardckpt.demo.job``)."""
from __future__ import annotations

import argparse
import sys

EPILOG = """what it does (real processes, gloo on 127.0.0.1, no GPU or network needed; about 2 minutes):
  1. trains a 3.2M-parameter transformer on 2 ranks (shardckpt.runtime, FULL_SHARD), async save every K steps
  2. kill -9 of both ranks while a save is in flight
  3. verifies the last committed checkpoint; gc removes what the killed save left
  4. shardckpt convert to 3 ranks, then shardckpt diff against the source
  5. resumes on 3 ranks and trains to the end; checks the losses continue the killed run's
  6. shardckpt export --dtype bfloat16, verify --against, compares with the final weights
  7. writes OUT/loss.png and OUT/summary.json ("checksums_equal": true only if every check passed)

with --tiers (shardckpt.tiers, about 3 minutes): trains on 4 ranks as 2 simulated nodes, each step of K saved to
  its node's tier 0 and replicated to the other node, every M-th uploaded to tier 2; kill -9 of every rank and
  node 1's tier 0 deleted (the node is lost); node 0's 2 ranks restart, restore the newest complete step (node 1's
  shards from the replicas, every byte checked), train to the end; then a byte of node 0's newest copy is
  flipped and all 4 ranks restart: the corrupt copy must be excluded and a good one restored. Checks the
  restored steps, the losses, and verifies the surviving copies. Defaults: --out runs/demo-tiers --steps 160 --save-every 10 --crash-at 110,
  --persistent-every 40.

exit status: 0 every check passed, 1 a check failed or a stage could not run, 2 unusable settings
(--out a file or a directory holding other files, steps that do not fit).

examples:
  shardckpt demo
  shardckpt demo --out /tmp/demo --steps 120 --save-every 10 --crash-at 70
  shardckpt demo --tiers
"""


def register(sub) -> None:
    from shardckpt.demo.config import DemoConfig, TiersDemoConfig

    d, t = DemoConfig(), TiersDemoConfig()
    p = sub.add_parser("demo", help="train on 2 ranks with async saves, kill -9, convert, resume on 3, export",
                       description="Run the main job end to end: train sharded, checkpoint asynchronously, survive "
                                   "a kill -9, convert offline to another world size, resume there, export for "
                                   "inference, and check every step.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help=f"run directory (default: {d.out}, with --tiers {t.out}; an earlier demo's files "
                                 "there are replaced)")
    p.add_argument("--steps", type=int, help=f"training steps in all (default {d.steps}, with --tiers {t.steps})")
    p.add_argument("--save-every", type=int,
                   help=f"checkpoint interval (default {d.save_every}; with --tiers, tier 0's: {t.save_every})")
    p.add_argument("--crash-at", type=int, help=f"the save step during whose save the ranks are killed (default "
                                                f"{d.crash_at}; with --tiers, killed once this step is replicated: "
                                                f"{t.crash_at})")
    p.add_argument("--tiers", action="store_true", help="the tiers variant: a node lost, resumed from a peer's replica")
    p.add_argument("--persistent-every", type=int, help=f"with --tiers: tier-2 interval (default {t.persistent_every})")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from shardckpt.demo.config import DemoConfig, DemoError, DemoUsageError, TiersDemoConfig

    given = {k: v for k, v in (("out", args.out), ("steps", args.steps), ("save_every", args.save_every),
                               ("crash_at", args.crash_at), ("persistent_every", args.persistent_every)) if v is not None}
    try:
        if args.tiers:
            from shardckpt.demo.tiers_job import run_tiers_demo

            summary = run_tiers_demo(TiersDemoConfig(**given))
        else:
            from shardckpt.demo.job import run_demo

            if "persistent_every" in given:
                raise DemoUsageError("--persistent-every applies to the tiers variant (--tiers)")
            summary = run_demo(DemoConfig(**given))
    except DemoUsageError as e:
        print(f"shardckpt demo: error: {e}", file=sys.stderr)
        return 2  # a usage error, as the root parser's
    except DemoError as e:
        print(f"shardckpt demo: {e}", file=sys.stderr)
        return 1
    return 0 if summary["checksums_equal"] else 1
