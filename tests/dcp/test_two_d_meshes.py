"""examples/fsdp2_tp_checkpoint.py, tested: FSDP2 over tensor parallelism ((_StridedShard(0), Shard(0)) and
(Shard(0), Shard(1))) and HSDP ((Replicate(), Shard(0))) on 4 gloo ranks, saved by shardckpt.save and by dcp.save
through shardckpt's DCP backend, reload bit for bit at other meshes (TP only, FSDP only at ws 3, no mesh at ws 1),
and through convert and export."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file

import shardckpt
from tests._dist import run_ranks

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "fsdp2_tp_checkpoint.py")


def _example():
    spec = importlib.util.spec_from_file_location("fsdp2_tp_checkpoint", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full(sd):
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full(v) for v in sd]
    return sd.full_tensor() if hasattr(sd, "full_tensor") else sd.clone() if isinstance(sd, torch.Tensor) else sd


def _state(ex, model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return _full({"model": model_sd, "optim": optim_sd})


def _placements(model) -> dict:
    return {n: tuple(type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "()") for p in t.placements)
            for n, t in model.state_dict().items() if n.endswith("weight")}


def _save(path: str, layout: str, through_dcp: bool) -> tuple[dict, dict]:
    ex = _example()
    model = ex.build(layout)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ex.train(model, optim, 2)
    ex.save(model, optim, path, through_dcp)
    return _state(ex, model, optim), _placements(model)


def _load(path: str, layout: str, through_dcp: bool) -> dict:
    ex = _example()
    model = ex.build(layout)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ex.train(model, optim, 1)  # another state, which the load must replace everywhere
    ex.load(model, optim, path, through_dcp)
    return _state(ex, model, optim)


def _same(want, got, where=""):
    if isinstance(want, dict):
        assert set(want) == set(got), (where, set(want) ^ set(got))
        for k in want:
            _same(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(want) == len(got), where
        for i, (a, b) in enumerate(zip(want, got)):
            _same(a, b, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


STRIDED = {"up.weight": ("_StridedShard(0)", "Shard(0)"), "down.weight": ("Shard(0)", "Shard(1)")}
HSDP = {"up.weight": ("Replicate()", "Shard(0)"), "down.weight": ("Replicate()", "Shard(0)")}


@pytest.mark.parametrize("through_dcp", [False, True], ids=["shardckpt.save", "dcp.save"])
def test_fsdp_over_tp_reloads_at_tp_only_fsdp_only_ws3_and_ws1(tmp_path, through_dcp):
    path = str(tmp_path / "tp")
    want, placements = run_ranks(4, _save, path, "fsdp+tp", through_dcp)[0]
    assert placements == STRIDED, placements
    assert shardckpt.verify(path).ok
    for ws, layout in ((2, "tp"), (3, "fsdp"), (1, "none")):
        for got in run_ranks(ws, _load, path, layout, through_dcp):
            _same(want, got, f"{layout}@{ws}")
    if through_dcp:
        return
    converted = str(tmp_path / "ws3")
    shardckpt.convert(path, converted, world_size=3)
    assert shardckpt.verify(converted).ok
    _same(want, run_ranks(3, _load, converted, "fsdp", True)[0], "converted")  # and read through dcp.load
    shardckpt.export(path, str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(exported) == {f"model.{k}" for k in want["model"]} or set(exported) == set(want["model"]), exported
    for k, v in want["model"].items():
        assert torch.equal(exported.get(f"model.{k}", exported.get(k)), v), k


@pytest.mark.parametrize("through_dcp", [False, True], ids=["shardckpt.save", "dcp.save"])
def test_hsdp_reloads_at_fsdp_over_tp_and_at_ws3(tmp_path, through_dcp):
    path = str(tmp_path / "hsdp")
    want, placements = run_ranks(4, _save, path, "hsdp", through_dcp)[0]
    assert placements == HSDP, placements
    for ws, layout in ((4, "fsdp+tp"), (3, "fsdp")):
        for got in run_ranks(ws, _load, path, layout, through_dcp):
            _same(want, got, f"{layout}@{ws}")
