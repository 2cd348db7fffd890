"""The checkpoint path from and to CUDA tensors (GPU only: skipped without one; run on a lent GPU, issue 41).

Saves stage CUDA tensors through host copies (``async_save``: pinned buffers on a side stream), loads fill CUDA
targets through host buffers; both must give the bytes the CPU path gives, bit for bit, and an async save must
hold the values the call saw even when the caller changes or frees the tensors as soon as it returns."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt.checkpoint.async_save import release

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _state(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    return {"model": {
        "w": w.to(device),
        "wt": w.t().to(device),  # not contiguous
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16).to(device),
        "half": torch.randn(5, generator=g).half().to(device),
        "ids": torch.randint(-2**40, 2**40, (9,), generator=g).to(device),
        "mask": (torch.randn(11, generator=g) > 0).to(device),
        "scalar": torch.tensor(3.5).to(device),
        "empty": torch.empty(0, 4).to(device),
        "cplx": torch.randn(4, 2, generator=g, dtype=torch.complex64).conj().to(device),  # a lazy conj bit
    }, "step": 3}


def _cpu(state: dict) -> dict:
    return {k: v.cpu().resolve_conj() for k, v in state["model"].items()}


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().resolve_conj().contiguous(), b.cpu().resolve_conj().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8)) \
        if a.numel() and a.dim() else a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        release()
        dist.destroy_process_group()


def test_a_checkpoint_saved_from_cuda_equals_one_saved_from_cpu_and_loads_into_cuda(tmp_path):
    on_gpu, on_cpu = _state("cuda"), _state("cpu")
    shardckpt.save(on_gpu, tmp_path / "gpu")
    shardckpt.save(on_cpu, tmp_path / "cpu")
    full_gpu, full_cpu = shardckpt.load_full(tmp_path / "gpu"), shardckpt.load_full(tmp_path / "cpu")
    for k, v in _cpu(on_cpu).items():
        assert _equal_bytes(full_gpu["model"][k], v), k
        assert _equal_bytes(full_cpu["model"][k], v), k
    assert shardckpt.diff(tmp_path / "gpu", tmp_path / "cpu").equal
    for source in ("gpu", "cpu"):
        target = {"model": {k: torch.zeros_like(v.resolve_conj()) for k, v in on_gpu["model"].items()}, "step": 0}
        shardckpt.load(target, tmp_path / source)
        assert target["step"] == 3
        for k, v in target["model"].items():
            assert v.is_cuda, k
            assert _equal_bytes(v, on_cpu["model"][k]), (source, k)


def test_dtensors_on_a_cuda_mesh_save_and_load_bit_for_bit(tmp_path, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (1,))
    plain = {k: v for k, v in _state("cuda")["model"].items() if v.dim() and not v.is_complex()}
    state = {"model": {k: distribute_tensor(v.contiguous(), mesh, [Shard(0)]) for k, v in plain.items()}}
    shardckpt.save(state, tmp_path / "ck")
    target = {"model": {k: DTensor.from_local(torch.zeros_like(v.to_local()), mesh, v.placements)
                        for k, v in state["model"].items()}}
    shardckpt.load(target, tmp_path / "ck")
    for k, v in plain.items():
        assert _equal_bytes(target["model"][k].to_local(), v), k
        assert _equal_bytes(shardckpt.load_full(tmp_path / "ck")["model"][k], v), k


def test_async_save_from_cuda_holds_the_values_at_the_call_when_they_change_or_are_freed_at_once(tmp_path, world):
    big = {f"w{i}": torch.randn(2048, 2048, device="cuda") for i in range(8)}  # 128 MiB: copies take time
    for step in range(3):  # the first call allocates pinned buffers; later ones reuse them
        want = {k: v.clone() for k, v in big.items()}
        state = {"model": dict(big), "scratch": torch.full((1 << 20,), float(step), device="cuda"), "step": step}
        handle = shardckpt.async_save(state, tmp_path / f"s{step}")
        for v in big.values():
            v.mul_(-2.0).add_(1.0)  # an optimizer step on the current stream, queued before the copies land
        del state["scratch"]  # freed by the caller at once: its memory must not be reused under the copy
        torch.empty(1 << 22, device="cuda").fill_(7.0)
        handle.wait()
        saved = shardckpt.load_full(tmp_path / f"s{step}")
        assert saved["step"] == step
        assert torch.equal(saved["scratch"], torch.full((1 << 20,), float(step)))
        for k, v in want.items():
            assert torch.equal(saved["model"][k], v.cpu()), (step, k)


def test_runtime_state_loaded_into_cuda_and_saved_again_converts_and_exports_as_the_cpu_path_does(tmp_path, world):
    """The sharding runtime's LOCAL state, trained on CPU and saved, loaded into the same model on CUDA and saved
    from there: the CUDA save equals the CPU one, and its conversion and export are the same files, bit for bit."""
    from shardckpt.runtime import shard
    from tests.runtime import _model

    model = shard(_model.make_model(), wrap=(_model.Block,))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in _model.make_batches(2):
        optim.zero_grad()
        _model.loss_fn(model, *batch).backward()
        optim.step()
    sources = {"cpu": tmp_path / "cpu", "cuda": tmp_path / "cuda"}
    shardckpt.save_state(model, optim, sources["cpu"], type=shardckpt.StateDictType.LOCAL_STATE_DICT)
    on_gpu = shard(_model.make_model(seed=5).cuda(), wrap=(_model.Block,))
    gpu_optim = torch.optim.AdamW(on_gpu.parameters(), lr=1e-2)
    shardckpt.load_state(on_gpu, gpu_optim, sources["cpu"])
    assert all(p.is_cuda for p in on_gpu.parameters())
    shardckpt.save_state(on_gpu, gpu_optim, sources["cuda"], type=shardckpt.StateDictType.LOCAL_STATE_DICT)
    assert shardckpt.diff(sources["cuda"], sources["cpu"]).equal
    for device, src in sources.items():
        shardckpt.convert(src, tmp_path / f"{device}-ws3", world_size=3, type="sharded")
        shardckpt.export(src, tmp_path / f"{device}-hf", dtype="bfloat16")
    assert shardckpt.diff(tmp_path / "cuda-ws3", tmp_path / "cpu-ws3").equal
    names = sorted(os.listdir(tmp_path / "cpu-hf"))
    assert names == sorted(os.listdir(tmp_path / "cuda-hf"))
    for name in names:
        assert (tmp_path / "cuda-hf" / name).read_bytes() == (tmp_path / "cpu-hf" / name).read_bytes(), name


def test_a_synchronous_save_streams_device_tensors_and_saves_the_work_queued_before_it(tmp_path):
    """Contiguous CUDA pieces stay on the device until the writer copies them a slice at a time (no whole host
    copy); the values written are those after every kernel queued before the call."""
    from shardckpt.checkpoint.stage import stage

    w = torch.randn(4096, 4096, device="cuda")  # 64 MiB: several slices
    staged = stage({"w": w, "wt": w[:8].t()})
    assert staged.pieces["w"].data.is_cuda and staged.pieces["w"].data.data_ptr() == w.data_ptr()
    assert not staged.pieces["wt"].data.is_cuda  # not contiguous: copied to the host
    want = w.clone()
    for _ in range(20):
        want.mul_(1.5).sub_(0.25)
    torch.cuda.synchronize()
    for _ in range(20):
        w.mul_(1.5).sub_(0.25)  # queued, not finished, when save is called
    shardckpt.save({"w": w}, tmp_path / "ck")
    assert torch.equal(shardckpt.load_full(tmp_path / "ck")["w"], want.cpu())
