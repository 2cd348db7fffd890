"""DTensor state from torch's own FSDP2 (`fully_shard`) saves and loads across world sizes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardckpt
from tests._dist import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: dim 0 does not divide by 2 or 3; the bias (5) is smaller than some chunk counts.
    return nn.Sequential(nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5))


def _fsdp2_model(seed_offset: float = 0.0) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed_offset)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_fsdp2(path: str) -> None:
    model = _fsdp2_model()
    sd = model.state_dict()
    assert any(type(v).__name__ == "DTensor" for v in sd.values())
    shardckpt.save({"model": sd}, path)


def _load_fsdp2(path: str) -> dict:
    model = _fsdp2_model(seed_offset=1.0)  # different values, to be overwritten
    sd = model.state_dict()
    shardckpt.load({"model": sd}, path)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("save_ws,load_ws", [(2, 3), (3, 1)])
def test_fsdp2_state_reshards(tmp_path, save_ws, load_ws):
    path = str(tmp_path / "ckpt")
    run_ranks(save_ws, _save_fsdp2, path)
    want = _model().state_dict()
    for rank_result in run_ranks(load_ws, _load_fsdp2, path):
        for k, v in want.items():
            assert torch.equal(rank_result[k], v), k
    full = shardckpt.load_full(path)["model"]
    assert all(torch.equal(full[k], v) for k, v in want.items())
