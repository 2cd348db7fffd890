"""``shardckpt.load`` from the other formats: a state dict of any sharding filled from a torch DCP directory,
a safetensors file or a torch.save file, at any world size, as from shardckpt's own format."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardckpt
from shardckpt import IncompatibleCheckpointError, ShardedTensor
from tests._dist import run_ranks


def _full() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(11, 6, generator=g), "b": torch.randn(6, generator=g).bfloat16(),
                      "s": torch.tensor(0.5)}}


def _write_all(root: str) -> None:
    full = _full()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp.save without a process group says so
        dcp.save({"model": dict(full["model"]), "step": 7}, checkpoint_id=f"{root}/dcp")
    save_file({f"model.{k}": v for k, v in full["model"].items()}, f"{root}/m.safetensors")
    torch.save({"model": full["model"], "step": 7}, f"{root}/m.pt")


def _load_chunks(path: str) -> list:
    """This rank's dim-0 chunk of every tensor, loaded from ``path``; returns them with the plain step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full()["model"]
    sd = {"model": {k: ShardedTensor.from_full(torch.zeros_like(v), rank, world) if v.dim() else torch.zeros_like(v)
                    for k, v in full.items()}}
    if not path.endswith(".safetensors"):
        sd["step"] = 0
    shardckpt.load(sd, path)
    got = {k: v.local if isinstance(v, ShardedTensor) else v for k, v in sd["model"].items()}
    want = {k: ShardedTensor.from_full(v, rank, world).local if v.dim() else v for k, v in full.items()}
    return [all(torch.equal(got[k], want[k]) for k in want), sd.get("step")]


@pytest.mark.parametrize("name", ["dcp", "m.safetensors", "m.pt"])
@pytest.mark.parametrize("world", [1, 3])
def test_load_into_shards_from_another_format(tmp_path, name, world):
    if name != "m.safetensors":
        pytest.importorskip("torch.distributed.checkpoint")
    _write_all(str(tmp_path))
    results = run_ranks(world, _load_chunks, str(tmp_path / name)) if world > 1 else None
    if world == 1:
        # One process, no process group: the same call.
        full = _full()["model"]
        sd = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
        if name != "m.safetensors":
            sd["step"] = 0
        shardckpt.load(sd, tmp_path / name)
        assert all(torch.equal(sd["model"][k], full[k]) for k in full)
        results = [[True, sd.get("step")]]
    for ok, step in results:
        assert ok and step in (7, None)


def test_a_strict_mismatch_is_refused_before_reading(tmp_path):
    _write_all(str(tmp_path))
    with pytest.raises(IncompatibleCheckpointError, match="missing"):
        shardckpt.load({"model": {"w": torch.zeros(11, 6)}, "other": torch.zeros(1)}, tmp_path / "dcp")
