"""A deterministic reference state dict and ways to shard it, shared by save/load tests (runs in workers too)."""
from __future__ import annotations

import contextlib

import torch

from shardckpt import Box, ShardedTensor
from shardckpt.tensor_views import as_bytes

KINDS = ("dim0", "flat", "plain", "cols")


@contextlib.contextmanager
def block_size(n: int):
    """Saves in this block write checksum blocks (and compressed frames) of ``n`` bytes."""
    from shardckpt.checkpoint import writer

    old = writer.BLOCK_SIZE
    writer.BLOCK_SIZE = n
    try:
        yield
    finally:
        writer.BLOCK_SIZE = old


def reference() -> dict:
    """Full tensors covering the awkward cases: dim 0 not divisible by / smaller than the world size, 0-d,
    empty, bf16, fp16, int, bool; plus nested plain values."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model": {
            "embed.weight": torch.randn(7, 3, generator=g),
            "tiny": torch.randn(2, 5, generator=g),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
            "norm.bf16": torch.randn(5, 6, generator=g).bfloat16(),
            "half": torch.randn(9, generator=g).half(),
            "count": torch.arange(11, dtype=torch.int64) * 3 - 7,
            "mask": torch.rand(6, generator=g) > 0.5,
            "cube": torch.randn(3, 4, 5, generator=g),
        },
        "step": 10,
        "meta": {"lrs": [0.1, 0.01], "name": "run-a", "nested": {"x": None, "ok": True}},
    }


def shard(full: torch.Tensor, kind: str, rank: int, world: int):
    if kind == "dim0":
        return ShardedTensor.from_full(full, rank, world)
    if kind == "flat":
        return ShardedTensor.even_flat_shard(full, rank, world)
    if kind == "cols" and full.dim() >= 2:
        # A tensor-parallel style block: a chunk of the last dim (not contiguous in row-major order).
        width = -(-full.shape[-1] // world)
        lo, hi = min(rank * width, full.shape[-1]), min((rank + 1) * width, full.shape[-1])
        offsets = (0,) * (full.dim() - 1) + (lo,)
        return ShardedTensor(full[..., lo:hi].contiguous(), tuple(full.shape), Box(offsets, full.shape[:-1] + (hi - lo,)))
    if kind == "cols":
        return ShardedTensor.from_full(full, rank, world)
    return full.clone()


def sharded_state(rank: int, world: int, rotate: int) -> dict:
    """The reference, each tensor sharded by a kind chosen by its position and ``rotate``."""
    sd = reference()
    sd["model"] = {k: shard(v, KINDS[(i + rotate) % len(KINDS)], rank, world)
                   for i, (k, v) in enumerate(sd["model"].items())}
    return sd


def empty_like_state(rank: int, world: int, rotate: int) -> dict:
    """Same structure as ``sharded_state`` but zero-filled tensors and different plain values."""
    sd = sharded_state(rank, world, rotate)
    for v in sd["model"].values():
        local = v.local if isinstance(v, ShardedTensor) else v
        local.zero_()
    sd["step"], sd["meta"] = -1, {}
    return sd


def check_equal(loaded: dict, rank: int, world: int, rotate: int) -> None:
    want = sharded_state(rank, world, rotate)
    for k, v in want["model"].items():
        got = loaded["model"][k]
        a = v.local if isinstance(v, ShardedTensor) else v
        b = got.local if isinstance(got, ShardedTensor) else got
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous())), k  # bit-exact, NaNs too
    assert loaded["step"] == want["step"] and loaded["meta"] == want["meta"]
