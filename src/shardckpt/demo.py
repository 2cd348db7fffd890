"""The end-to-end demonstration behind ``shardckpt demo``: save on 2 ranks, inspect, verify, reshard to 3.

It runs real processes with the gloo backend on 127.0.0.1, on a generated transformer-shaped state
dict, and checks every value it loads bit for bit against the source.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable

import torch
import torch.multiprocessing as mp

from shardckpt.checkpoint.describe import describe
from shardckpt.checkpoint.load import load, load_full
from shardckpt.checkpoint.save import save
from shardckpt.checkpoint.verify import verify
from shardckpt.dist.world import host_store, joined
from shardckpt.sharded_tensor import ShardedTensor


def transformer_state(layers: int, hidden: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 tensors shaped like a small decoder-only transformer (names as in a HF Llama)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        sd[p + "mlp.up_proj.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        sd[p + "mlp.down_proj.weight"] = torch.randn(hidden, 4 * hidden, generator=g)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    sd["model.norm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return sd


def _sharded(full: dict[str, torch.Tensor], rank: int, world: int) -> dict:
    return {"model": {k: ShardedTensor.from_full(v, rank, world) for k, v in full.items()}, "step": 100}


def _worker(rank: int, world: int, port: int, job: Callable, args: tuple) -> None:
    with joined(rank, world, port):  # leaves after every rank is done
        job(rank, world, *args)


def _save_job(rank: int, world: int, path: str, shape: tuple) -> None:
    save(_sharded(transformer_state(*shape), rank, world), path)


def _load_job(rank: int, world: int, path: str, shape: tuple) -> None:
    want = _sharded(transformer_state(*shape), rank, world)
    got = {"model": {k: ShardedTensor(torch.empty_like(v.local), v.global_shape, v.region)
                     for k, v in want["model"].items()}, "step": 0}
    load(got, path)
    bad = [k for k, v in want["model"].items() if not torch.equal(v.local, got["model"][k].local)]
    if bad or got["step"] != 100:
        raise SystemExit(f"rank {rank}: loaded values differ from the source: {bad[:5]}")


def _spawn(world: int, job: Callable, *args) -> None:
    """Run ``job(rank, world, *args)`` on ``world`` gloo processes. The parent hosts the rendezvous store on a
    port the OS picks, so no free-port guess can race with another process."""
    store = host_store(world)
    mp.spawn(_worker, args=(world, store.port, job, args), nprocs=world, join=True)


def run_demo(workdir: str | None = None, layers: int = 4, hidden: int = 256, vocab: int = 8000,
             say: Callable[[str], None] = print) -> None:
    """Save on 2 ranks -> inspect -> verify -> load on 3 ranks -> load whole -> catch a flipped byte ->
    train sharded on 2 ranks, checkpoint, resume on 3."""
    root = workdir or tempfile.mkdtemp(prefix="shardckpt-demo-")
    path = os.path.join(root, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    shape = (layers, hidden, vocab)
    full = transformer_state(*shape)
    mib = sum(t.numel() * t.element_size() for t in full.values()) / 2**20
    say(f"1. save: {len(full)} tensors, {mib:.1f} MiB, dim-0 sharded over 2 gloo ranks -> {path}")
    t = time.perf_counter()
    _spawn(2, _save_job, path, shape)
    say(f"   saved in {time.perf_counter() - t:.2f} s (including process start)")
    info = describe(path)
    say(f"2. inspect: world size {info['world_size']}, {len(info['tensors'])} tensors, {info['total_bytes']:,} bytes "
        f"in {info['files']} files; e.g. {info['tensors'][0]['name']} {info['tensors'][0]['shape']} "
        f"crc32c {info['tensors'][0]['crc32c']}")
    report = verify(path)
    say(f"3. verify: {'OK' if report.ok else 'FAILED'} ({report.chunks} chunks, {report.bytes_checked:,} bytes)")
    if not report.ok:
        raise SystemExit("\n".join(map(str, report.problems)))
    _spawn(3, _load_job, path, shape)
    say("4. load on 3 ranks (resharded from 2): every value equal to the source")
    whole = load_full(path, keys=["model"])["model"]
    assert all(torch.equal(whole[k], v) for k, v in full.items())
    say("5. load_full in one process: every tensor equal to the source")
    _flip_a_byte(path)
    bad = verify(path)
    say(f"6. after flipping one byte in a data file, verify reports: {bad.problems[0] if bad.problems else 'nothing!'}")
    if bad.ok:
        raise SystemExit("verify missed a flipped byte")
    _training_demo(root, say)
    say(f"done; files are in {root}")


def _training_demo(root: str, say: Callable[[str], None], steps: int = 4) -> None:
    """Train sharded on 2 ranks, save LOCAL, resume on 3 ranks from the files, compare with no interruption."""
    from shardckpt.demo_train import read_losses, report_path, train_job

    ckpt = os.path.join(root, "train-ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    _spawn(2, train_job, 0, steps, None, ckpt, report_path(root, "first"))
    first = read_losses(report_path(root, "first"))
    say(f"7. train a sharded model (runtime, FULL_SHARD) on 2 ranks, {steps} AdamW steps: loss "
        f"{first[0]:.4f} -> {first[-1]:.4f}; saved as a LOCAL checkpoint (flat shards + layouts)")
    _spawn(3, train_job, steps, 2 * steps, ckpt, None, report_path(root, "resumed"))
    resumed = read_losses(report_path(root, "resumed"))
    _spawn(2, train_job, 0, 2 * steps, None, None, report_path(root, "straight"))
    straight = read_losses(report_path(root, "straight"))[steps:]
    gap = max(abs(a - b) for a, b in zip(resumed, straight))
    say(f"8. resume on 3 ranks (load_state reads each new shard from the 2-rank files), {steps} more steps: loss "
        f"{resumed[0]:.4f} -> {resumed[-1]:.4f}; uninterrupted 2-rank run {straight[0]:.4f} -> {straight[-1]:.4f} "
        f"(largest difference {gap:.1e}: only the reduction order changed)")
    if gap > 1e-3:
        raise SystemExit("the resumed run diverged from the uninterrupted one")


def _flip_a_byte(path: str) -> None:
    for dirpath, _, names in os.walk(path):
        for name in sorted(names):
            if name.endswith(".bin"):
                with open(os.path.join(dirpath, name), "r+b") as f:
                    f.seek(12345)
                    b = f.read(1)
                    f.seek(12345)
                    f.write(bytes([b[0] ^ 1]))
                return
