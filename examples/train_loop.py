"""Train sharded with shardckpt's runtime, checkpoint asynchronously, resume at any world size.

    torchrun --standalone --nproc-per-node 2 examples/train_loop.py --ckpt runs/example --steps 20
    torchrun --standalone --nproc-per-node 3 examples/train_loop.py --ckpt runs/example --steps 40
    torchrun --nproc-per-node 8 examples/train_loop.py --ckpt s3://bucket/run --device cuda     # NCCL
"""
import argparse
import os

import torch
import torch.distributed as dist

import shardckpt
from shardckpt import StateDictType
from shardckpt.demo.model import GLOBAL_BATCH, Block, DemoTransformer, global_batch, loss_of
from shardckpt.runtime import shard

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True, help="run directory or URL: step-N checkpoints go here")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--save-every", type=int, default=10)
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = p.parse_args()

dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)  # the same initial weights on every rank
model = shard(DemoTransformer().to(args.device), wrap=(Block,))  # FULL_SHARD, one flat group per block
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over this rank's flat shards

start = 0
last = shardckpt.latest_checkpoint(args.ckpt)  # the newest committed one; a killed save's debris is skipped
if last:
    start = shardckpt.load_state(model, optim, last)["step"]  # saved at any world size, read into our shards
    if rank == 0:
        print(f"resumed from {last} at step {start} on {world} ranks")

per_rank = GLOBAL_BATCH // world
saving = None
for step in range(start, args.steps):
    seqs = global_batch(step)[rank * per_rank:(rank + 1) * per_rank].to(args.device)
    optim.zero_grad()
    loss = loss_of(model, seqs)
    loss.backward()
    optim.step()
    if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
        # Returns once the state is copied to host buffers; the write and commit run in the background.
        saving = shardckpt.async_save_state(model, optim, f"{args.ckpt}/step-{step + 1:06d}", extra={"step": step + 1})
    if rank == 0 and step % 10 == 0:
        print(f"step {step} loss {loss.item():.3f}")

if saving:
    saving.wait()  # the last checkpoint is committed before we leave (raises if it failed)
dist.destroy_process_group()
