"""Keep torch FSDP2 (``fully_shard``) for training and use shardckpt for the checkpoints only.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_checkpoint.py --ckpt runs/fsdp2 --steps 20
    torchrun --standalone --nproc-per-node 3 examples/fsdp2_checkpoint.py --ckpt runs/fsdp2 --steps 40
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import shardckpt
from shardckpt.demo.model import GLOBAL_BATCH, DemoTransformer, global_batch, loss_of

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--save-every", type=int, default=10)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DemoTransformer()
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

start = 0
last = shardckpt.latest_checkpoint(args.ckpt)
if last:
    model_sd, optim_sd = get_state_dict(model, optim)  # DTensors: this rank's shards, the DCP habit
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    shardckpt.load(state, last)  # fills them in place from a checkpoint of any world size
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = state["step"]
    if rank == 0:
        print(f"resumed from {last} at step {start} on {world} ranks")

per_rank = GLOBAL_BATCH // world
saving = None
for step in range(start, args.steps):
    optim.zero_grad()
    loss = loss_of(model, global_batch(step)[rank * per_rank:(rank + 1) * per_rank])
    loss.backward()
    optim.step()
    if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": step + 1}
        saving = shardckpt.async_save(state, f"{args.ckpt}/step-{step + 1:06d}")  # blocked only while staging
    if rank == 0 and step % 10 == 0:
        print(f"step {step} loss {loss.item():.3f}")

if saving:
    saving.wait()
dist.destroy_process_group()
