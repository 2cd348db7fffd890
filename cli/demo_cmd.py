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

exit status: 0 every check passed, 1 a check failed or a stage could not run, 2 unusable settings
(--out a file or a directory holding other files, steps that do not fit).

examples:
  shardckpt demo
  shardckpt demo --out /tmp/demo --steps 120 --save-every 10 --crash-at 70
"""


def register(sub) -> None:
    from shardckpt.demo.config import DemoConfig

    d = DemoConfig()
    p = sub.add_parser("demo", help="train on 2 ranks with async saves, kill -9, convert, resume on 3, export",
                       description="Run the main job end to end: train sharded, checkpoint asynchronously, survive "
                                   "a kill -9, convert offline to another world size, resume there, export for "
                                   "inference, and check every step.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=d.out, help=f"run directory (default: {d.out}; an earlier demo's files there are replaced)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps in all (default {d.steps})")
    p.add_argument("--save-every", type=int, default=d.save_every, help=f"checkpoint interval (default {d.save_every})")
    p.add_argument("--crash-at", type=int, default=d.crash_at,
                   help=f"the save step during whose save the ranks are killed (default {d.crash_at})")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from shardckpt.demo.config import DemoConfig, DemoError, DemoUsageError
    from shardckpt.demo.job import run_demo

    try:
        summary = run_demo(DemoConfig(out=args.out, steps=args.steps, save_every=args.save_every, crash_at=args.crash_at))
    except DemoUsageError as e:
        print(f"shardckpt demo: error: {e}", file=sys.stderr)
        return 2  # a usage error, as the root parser's
    except DemoError as e:
        print(f"shardckpt demo: {e}", file=sys.stderr)
        return 1
    return 0 if summary["checksums_equal"] else 1
