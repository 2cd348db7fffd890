"""The CUDA checkpoint path on one GPU, side by side with torch DCP, against the machine's own limits (issue 41).

State: ~``--gib`` GiB of CUDA tensors shaped like a transformer's fp32 master weights (64 MiB matrices, a few
norm vectors, a 0-d step), as torch DTensors ``Shard(0)`` on a one-GPU mesh, which is what FSDP2's
``get_state_dict`` gives in a world of one. Every repeat measures, in this order:

- the limits: a pinned device-to-host copy of the whole state into buffers that already exist (``d2h_pinned``),
  into fresh pageable memory (``d2h_pageable``), host-to-device from pinned memory (``h2d_pinned``), a raw
  write of those bytes with one fsync (``disk_write``), and a cold read of them (``disk_read``);
- ``save``: ``shardckpt.save`` and ``dcp.save`` (both fsync their files);
- ``load`` into CUDA DTensors, page cache dropped first: ``shardckpt.load`` and ``dcp.load``;
- ``async_save``, two calls each (the first allocates staging buffers; the second is the steady state), the
  state changed in place right after each call returns: shardckpt's time until the call returns and until the
  GPU's current stream may go on (``..._blocked``: the return plus a sync of the current stream), torch's
  default ``dcp.async_save``, and ``dcp.async_save`` with its pinned-memory ``DefaultStager`` (blocked until its
  staging completes, which is when training may change the weights).

The first repeat also checks that every load, and every async save of a state changed right after the call,
holds the values the call saw, bit for bit. Results are written to ``--json`` after every measurement, so a
run cut short keeps what it measured.

    python benchmarks/bench_cuda_ckpt.py --gib 8 --repeats 3 --dir /tmp/bench --json out.json
    python benchmarks/bench_cuda_ckpt.py --quick          # ~256 MiB, 1 repeat; on CPU too (no pinned rows)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from _common import drop_caches, median

MATRIX = (4096, 4096)  # 64 MiB in fp32


def make_state(gib: float, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    n = max(1, int(gib * (1 << 30)) // (MATRIX[0] * MATRIX[1] * 4))
    state = {f"layers.{i}.w": torch.randn(MATRIX, generator=g, device=device) for i in range(n)}
    state.update({f"layers.{i}.norm": torch.randn(MATRIX[1], generator=g, device=device) for i in range(n)})
    state["step"] = torch.tensor(7.0, device=device)
    return state


def as_dtensors(state: dict[str, torch.Tensor], mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)] if v.dim() else []) if v.dim() else v
                      for k, v in state.items()}}


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def empty_like_state(state: dict) -> dict:
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in state["model"].items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements)
        else:
            out[k] = torch.empty_like(v)
    return {"model": out}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(local(a["model"][k]), local(v)) for k, v in b["model"].items())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def limits(state: dict, scratch: str, cuda: bool) -> dict[str, float]:
    tensors = [local(v) for v in state["model"].values()]
    out: dict[str, float] = {}
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    out["d2h_pinned"] = timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors)])
    out["d2h_pageable"] = timed(lambda: [t.to("cpu") for t in tensors])
    if cuda:
        out["h2d_pinned"] = timed(lambda: [t.copy_(p, non_blocking=True) for p, t in zip(pinned, tensors)])
    path = os.path.join(scratch, "raw.bin")

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for p in pinned:
                view = memoryview(p.reshape(-1).view(torch.uint8).numpy())
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            for p in pinned:
                view = memoryview(p.reshape(-1).view(torch.uint8).numpy())
                while view:
                    view = view[f.readinto(view):]

    out["disk_write"] = timed(write)
    drop_caches()
    out["disk_read"] = timed(read)
    os.unlink(path)
    del pinned
    return out


def saves_and_loads(state: dict, scratch: str, check: bool) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    import shardckpt
    out: dict[str, float] = {}
    ours, theirs = os.path.join(scratch, "ours"), os.path.join(scratch, "dcp")
    out["save_shardckpt"] = timed(lambda: shardckpt.save(state, ours))
    out["save_dcp"] = timed(lambda: dcp.save(state, checkpoint_id=theirs))
    for name, path, load in (("shardckpt", ours, lambda t, p: shardckpt.load(t, p)),
                             ("dcp", theirs, lambda t, p: dcp.load(t, checkpoint_id=p))):
        target = empty_like_state(state)
        drop_caches()
        out[f"load_{name}"] = timed(lambda: load(target, path))
        if check:
            out[f"load_{name}_equal"] = float(same(target, state))
        del target
    shutil.rmtree(ours)
    shutil.rmtree(theirs)
    return out


def async_saves(state: dict, scratch: str, check: bool, method: str) -> dict[str, float]:
    """Two async saves by ``method``, the state changed in place right after each call returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import shardckpt
    out: dict[str, float] = {}
    tensors = [local(v) for v in state["model"].values()]
    if method == "dcp_pinned":
        # torch 2.11's DefaultStager cannot deep-copy a DTensor (KeyError: <class 'type'>): in a world of one
        # its local tensors are the same bytes, saved as replicated.
        state = {"model": {k: local(v) for k, v in state["model"].items()}}
    stager = DefaultStager(StagingOptions(True, False, True, True)) if method == "dcp_pinned" else None
    for i in range(2):
        path = os.path.join(scratch, f"{method}-{i}")
        want = {"model": {k: local(v).clone() for k, v in state["model"].items()}} if check else None
        sync()
        t = time.perf_counter()
        if method == "shardckpt":
            handle = shardckpt.async_save(state, path)
            returned = time.perf_counter() - t
            sync()
            blocked = time.perf_counter() - t
        elif method == "dcp":
            handle = dcp.async_save(state, checkpoint_id=path)
            returned = blocked = time.perf_counter() - t
        else:
            handle = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            returned = time.perf_counter() - t
            handle.staging_completion.result()
            blocked = time.perf_counter() - t
        for v in tensors:  # an optimizer step right after the call
            v.add_(1.0)
        t = time.perf_counter()
        if method == "shardckpt":
            handle.wait()
        elif method == "dcp":
            handle.result()
        else:
            handle.upload_completion.result()
        out[f"async_{method}_{i}_returned"] = returned
        out[f"async_{method}_{i}_blocked"] = blocked
        out[f"async_{method}_{i}_wait_after"] = time.perf_counter() - t
        if check:
            target = empty_like_state(state)
            if method == "shardckpt":
                shardckpt.load(target, path)
            else:
                dcp.load(target, checkpoint_id=path)
            out[f"async_{method}_{i}_equal"] = float(same(target, want))
            del target, want
        shutil.rmtree(path)
    if stager is not None:
        stager.close()
    if method == "shardckpt":
        from shardckpt.checkpoint.async_save import release
        release()
    return out


def init_world(cuda: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}")


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: median([r[k] for r in runs if k in r]) for k in keys}


def ratios(m: dict[str, float]) -> dict[str, float]:
    """The figures the issue's targets name, from what has been measured so far."""
    r: dict[str, float] = {}
    if "save_dcp" not in m or "load_dcp" not in m:
        return r
    d2h, write, read = m.get("d2h_pinned"), m.get("disk_write"), m.get("disk_read")
    h2d = m.get("h2d_pinned", 0.0)
    if d2h:
        for method in ("shardckpt", "dcp", "dcp_pinned"):
            if f"async_{method}_1_blocked" in m:
                r[f"async_{method}_steady_blocked / d2h_pinned"] = m[f"async_{method}_1_blocked"] / d2h
    if d2h and write:
        for method in ("shardckpt", "dcp"):
            r[f"save_{method} / (d2h_pinned + disk_write)"] = m[f"save_{method}"] / (d2h + write)
    if read:
        for method in ("shardckpt", "dcp"):
            r[f"load_{method} / (disk_read + h2d_pinned)"] = m[f"load_{method}"] / (read + h2d)
    for what in ("save", "load"):
        if f"{what}_dcp" in m:
            r[f"{what}_shardckpt / {what}_dcp"] = m[f"{what}_shardckpt"] / m[f"{what}_dcp"]
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="write the results here (after every measurement)")
    ap.add_argument("--quick", action="store_true", help="~256 MiB, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.25, 1
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    init_world(cuda)
    from torch.distributed.device_mesh import init_device_mesh
    state = as_dtensors(make_state(args.gib, device), init_device_mesh(device, (1,)))
    nbytes = sum(local(v).nbytes for v in state["model"].values())
    scratch = tempfile.mkdtemp(dir=args.dir, prefix="bench_cuda_")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if cuda
           else "cpu", "gib": nbytes / (1 << 30), "tensors": len(state["model"])}
    result: dict = {"env": env, "runs": []}
    print(json.dumps(env), flush=True)

    def record(run: dict, part: dict) -> None:
        run.update(part)
        result["summary"] = summary(result["runs"])
        result["ratios"] = ratios(result["summary"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(part), flush=True)

    try:
        for i in range(args.repeats):
            run: dict[str, float] = {}
            result["runs"].append(run)
            record(run, limits(state, scratch, cuda))
            record(run, saves_and_loads(state, scratch, check=i == 0))
            for method in ("shardckpt", "dcp", "dcp_pinned") if cuda else ("shardckpt", "dcp"):
                try:
                    record(run, async_saves(state, scratch, i == 0, method))
                except Exception as e:  # a peer's failure (torch 2.11's DefaultStager) must not end the run
                    result.setdefault("errors", {})[method] = f"{type(e).__name__}: {e}"
                    print(f"async {method} failed: {type(e).__name__}: {e}", flush=True)
                    shutil.rmtree(scratch, ignore_errors=True)
                    os.makedirs(scratch, exist_ok=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    print(json.dumps(result["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
