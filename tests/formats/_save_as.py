"""A state dict written in one of the formats the readers read (the readers' destination tests share it)."""
from __future__ import annotations

import warnings

import torch

import shardckpt


def save_as(fmt: str, state: dict, path: str) -> None:
    """``state`` saved at ``path`` as ``fmt``: "shardckpt", "torch", "safetensors" or torch DCP (anything else)."""
    if fmt == "shardckpt":
        shardckpt.save(state, path)
    elif fmt == "torch":
        torch.save(state, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(state, path)
    else:
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({k: v.clone() for k, v in state.items()}, storage_writer=dcp.FileSystemWriter(path))
