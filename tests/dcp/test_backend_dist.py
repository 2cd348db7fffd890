"""The DCP backend across ranks: FSDP2 model and optimizer state saved by dcp.save / dcp.async_save through
``StorageWriter`` at one world size, loaded bit for bit at others by dcp.load through ``StorageReader`` and by
shardckpt's own load; a DeepSpeed ZeRO checkpoint loaded into an FSDP2 model by dcp.load."""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardckpt
from shardckpt.dcp import StorageReader, StorageWriter
from tests._dist import run_ranks

warnings.filterwarnings("ignore", category=FutureWarning)
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                        "deepspeed")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: dim 0 does not divide by 2, 3 or 4; the bias (5) is smaller than some chunk counts.
    return nn.Sequential(nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5))


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _trained(steps: int, perturb: float = 0.0):
    """An FSDP2 model and AdamW after ``steps`` steps on the same batch on every rank; ``perturb`` shifts the
    weights afterwards (a model whose state a load must overwrite)."""
    model = _fsdp2(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.arange(21.0).reshape(3, 7) / 10
    for _ in range(steps):
        optim.zero_grad()
        model(x).square().sum().backward()
        optim.step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb)
    return model, optim


def _state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
            "train_state": {"step": 2, "losses": [0.5, 0.25]}}


def _full(sd):
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full(v) for v in sd]
    return sd.full_tensor() if hasattr(sd, "full_tensor") else sd.clone() if isinstance(sd, torch.Tensor) else sd


def _save(path: str, how: str, compress: str | None) -> dict:
    model, optim = _trained(2)
    sd = _state(model, optim)
    writer = StorageWriter(path, compress=compress)
    if how == "save":
        dcp.save(sd, storage_writer=writer)
    else:  # torchtitan's call shape: a checkpoint_id beside the writer, the process group given
        pending = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, process_group=dist.group.WORLD)
        pending.result()
    return _full(sd)


def _load_dcp(path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optim = _trained(1, perturb=1.0)  # other values, and an optimizer state to overwrite
    sd = _state(model, optim)
    dcp.load(sd, storage_reader=StorageReader(path))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optim, sd["optim"])
    return _full(_state(model, optim)) | {"train_state": sd["train_state"]}


def _load_shardckpt(path: str) -> dict:
    model, optim = _trained(1, perturb=1.0)
    sd = _state(model, optim)
    shardckpt.load(sd, path)
    return _full(sd)


def _assert_same(want, got, where=""):
    if isinstance(want, dict):
        assert set(want) == set(got), (where, set(want) ^ set(got))
        for k in want:
            _assert_same(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("save_ws,how,compress,load_ws", [(2, "save", None, 3), (3, "async_save", "zstd", 2),
                                                           (4, "save", None, 1)])
def test_fsdp2_state_saved_through_dcp_reloads_bit_for_bit_at_other_world_sizes(tmp_path, save_ws, how,
                                                                                 compress, load_ws):
    path = str(tmp_path / "step-2")
    want = run_ranks(save_ws, _save, path, how, compress)[0]
    assert shardckpt.verify(path).ok
    for got in run_ranks(load_ws, _load_dcp, path):
        _assert_same(want, got)
    for got in run_ranks(2 if load_ws != 2 else 3, _load_shardckpt, path):
        _assert_same(want, got)
    full = shardckpt.load_full(path)
    _assert_same(want["model"], full["model"])
    _assert_same(want["train_state"], full["train_state"])


def _shardckpt_save(path: str) -> dict:
    model, optim = _trained(2)
    sd = _state(model, optim)
    shardckpt.save(sd, path)
    return _full(sd)


def test_a_checkpoint_saved_by_shardckpt_save_loads_through_dcp_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    want = run_ranks(3, _shardckpt_save, path)[0]
    for got in run_ranks(2, _load_dcp, path):
        _assert_same(want, got)


def _load_deepspeed(src: str) -> dict:
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
    model = mk.Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, storage_reader=StorageReader(src))
    set_model_state_dict(model, sd["model"])
    return _full(get_model_state_dict(model))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_deepspeed_checkpoint_loads_into_an_fsdp2_model_through_dcp_load(stage):
    expected = torch.load(os.path.join(FIXTURES, f"zero{stage}", "zero_to_fp32.pt"), weights_only=True)
    got = run_ranks(3, _load_deepspeed, os.path.join(FIXTURES, f"zero{stage}", "checkpoint"))[0]
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert torch.equal(got["head.weight"], got["embed.weight"])  # tied
