"""``shardckpt demo``: the end-to-end demonstration on built-in defaults."""
from __future__ import annotations

import argparse

EPILOG = """examples:
  shardckpt demo
  shardckpt demo --dir /tmp/demo --layers 8 --hidden 512
"""


def register(sub) -> None:
    p = sub.add_parser("demo", help="save on 2 ranks, inspect, verify, reshard to 3; train sharded, checkpoint, resume on 3",
                       description="Run the end-to-end demonstration on a generated transformer-shaped state dict, "
                                   "with real gloo processes on 127.0.0.1.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="working directory (default: a new temporary one)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8000)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from shardckpt.demo import run_demo

    run_demo(args.dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    return 0
