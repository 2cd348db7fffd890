"""FSDP2 over tensor parallelism (and HSDP): 2-D meshes saved by shardckpt, reloaded at any other mesh.

    torchrun --standalone --nproc-per-node 4 examples/fsdp2_tp_checkpoint.py --layout fsdp+tp --ckpt runs/tp
    torchrun --standalone --nproc-per-node 3 examples/fsdp2_tp_checkpoint.py --layout fsdp --ckpt runs/tp --load
    torchrun --standalone --nproc-per-node 4 examples/fsdp2_tp_checkpoint.py --layout hsdp --ckpt runs/hsdp --dcp
"""
import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardckpt
from shardckpt.dcp import StorageReader, StorageWriter


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 6)  # 16 rows: split by tp, then by dp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build(layout: str) -> nn.Module:
    """fsdp+tp: (dp, tp) = (ws/2, 2), up.weight (_StridedShard(0), Shard(0)), down.weight (Shard(0), Shard(1));
    hsdp: (replicate, shard) = (2, ws/2), (Replicate(), Shard(0)); tp, fsdp: 1-D; none: a plain model."""
    model, world = MLP(), dist.get_world_size()
    if layout == "fsdp+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), {"up": ColwiseParallel(),
                                                                      "down": RowwiseParallel()})
    elif layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        optim.zero_grad()
        model(torch.linspace(-1, 1, 24).reshape(4, 6) * (step + 1)).square().mean().backward()
        optim.step()


def save(model: nn.Module, optim: torch.optim.Optimizer, path: str, through_dcp: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    if through_dcp:  # DCP's own call; shardckpt is only its storage
        dcp.save(state, storage_writer=StorageWriter(path, overwrite=True))
    else:
        shardckpt.save(state, path, overwrite=True)


def load(model: nn.Module, optim: torch.optim.Optimizer, path: str, through_dcp: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    if through_dcp:
        dcp.load(state, storage_reader=StorageReader(path))
    else:
        shardckpt.load(state, path)  # this rank's shards, from a checkpoint of any mesh
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=["fsdp+tp", "hsdp", "tp", "fsdp", "none"], default="fsdp+tp")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--load", action="store_true", help="load --ckpt, then train one step")
    p.add_argument("--dcp", action="store_true", help="save/load with dcp.save/dcp.load through shardckpt.dcp")
    args = p.parse_args()
    dist.init_process_group("gloo")
    model = build(args.layout)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optim, 1)  # the optimizer state exists before a load
    if args.load:
        load(model, optim, args.ckpt, args.dcp)
    train(model, optim, 1)
    if not args.load:
        save(model, optim, args.ckpt, args.dcp)
    dist.destroy_process_group()
