"""Checkpoint tiers (issue 40) at world size 4 as 2 simulated nodes (ranks 0-1 node a, 2-3 node b; tier 0 in
``/dev/shm/bench-tiers-<pid>/<node>``, one replica each, tier 2 on local disk), ~``--gib`` GiB of fp32
transformer-shaped state (``bench_async_save.shapes``), each rank a dim-0 quarter.

1. **Blocked time per save** (max over ranks; each save waited for before the next, outside the timing; the
   state changed in place between saves; the methods' order rotating per repeat): ``copy`` (the limit),
   ``tiers`` (``CheckpointManager.save``: tier 0, replicated, uploaded to tier 2 on every save),
   ``async_save`` (``shardckpt.async_save`` to disk) and ``dcp`` (``torch.distributed.checkpoint.async_save``
   to disk). For ``tiers`` also the seconds until the tier-0 commit, the replicas, the tier-2 commit.
2. **Recovery** (fresh processes each, as torchrun restarts them; seconds from ``CheckpointManager`` start to
   ``restore`` returning, max over ranks, median of ``--repeats``; ``start_s``: of which the manager's start):
   ``tier0`` (nothing lost), ``node-lost ws4``
   (node b's tier 0 deleted, a replacement node b reads b's files from a's replicas over the peer server),
   ``node-lost ws2`` (node a alone, resharded 4 -> 2), ``tier2 disk cold`` (tier 0 gone everywhere, page cache
   dropped; at ws 4, and at ws 2 as the shrunk job's peer), and ``s3`` (the same checkpoint saved to moto on
   127.0.0.1, or the S3 endpoint given with ``--endpoint``, e.g. radosgw, and loaded by ``shardckpt.load`` at
   ws 4).
3. **Bytes moved per save**: tier 0, replicas pulled, uploaded; against ``async_save``'s bytes to disk.

    python benchmarks/bench_tiers.py            # ~1 GiB, 3 saves per method, 1 repeat
    python benchmarks/bench_tiers.py --quick    # ~128 MiB
    python benchmarks/bench_tiers.py --recovery-only --saves 1 --repeats 5 --no-s3   # recovery alone, ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import drop_caches, loadavg, median, spawn_gloo  # noqa: E402
from bench_async_save import shapes  # noqa: E402
from bench_s3 import _start_moto  # noqa: E402

METHODS = ("copy", "tiers", "async_save", "dcp")


def _config(root: dict, rank: int, world: int, run_id: str = "bench"):
    from shardckpt.tiers import TierConfig

    node = "node-a" if rank < 2 else "node-b"
    return TierConfig(local_dir=os.path.join(root["shm"], node), run_id=run_id, node_id=node,
                      persistent_dir=os.path.join(root["disk"], "tier2"), persistent_every=1, replicas=1 if world > 2 else 0,
                      keep_last=1, min_free="1GiB", peer_host="127.0.0.1", keep_local_on_close=True)


def _state(rank: int, world: int, sizes: dict, seed: int = 0) -> dict:
    from shardckpt import Box, ShardedTensor

    g = torch.Generator().manual_seed(seed * 10 + rank)
    out = {}
    for k, (a, b) in sizes.items():
        n = a // world
        out[k] = ShardedTensor(torch.randn(n, b, generator=g), (a, b), Box((rank * n, 0), (n, b)))
    return {"model": out, "step": 0}


def _save_job(rank: int, world: int, sizes: dict, root: dict, saves: int, out: str, order: tuple,
              first_step: int) -> None:
    import torch.distributed as dist

    import shardckpt
    from shardckpt.tiers import CheckpointManager

    state = _state(rank, world, sizes)
    local = {k: v.local for k, v in state["model"].items()}
    buffers = {k: torch.empty_like(v) for k, v in local.items()}
    dtensors = _dtensors(sizes, local, world)
    ckpt = CheckpointManager(_config(root, rank, world))
    blocked, lanes, moved = {m: [] for m in METHODS}, [], {}
    for method in order:
        for i in range(saves):
            for v in local.values():
                v.add_(1e-3)
            dist.barrier()
            handle, t = None, time.perf_counter()
            if method == "copy":
                for k, v in local.items():
                    buffers[k].copy_(v)
            elif method == "tiers":
                handle = ckpt.save(first_step + i, state)  # a new step each repeat: tier 2 keeps steps
            elif method == "async_save":
                handle = shardckpt.async_save(state, os.path.join(root["disk"], f"disk-{i}"), overwrite=True)
            else:
                handle = _dcp_save(dtensors, os.path.join(root["disk"], f"dcp-{i}"))
            dt = time.perf_counter() - t
            lane = _wait(method, handle, t)
            if lane is not None:
                lanes.append(lane)
                moved = ckpt.status()["moved"]
            times = [None] * world
            dist.all_gather_object(times, dt)
            blocked[method].append(max(times))
    ckpt.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"lanes": lanes, "moved": moved})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"blocked": blocked, "ranks": everyone}, f)
    dist.barrier()


def _dtensors(sizes: dict, local: dict, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {k: distribute_tensor(torch.empty(sizes[k]), mesh, [Shard(0)], src_data_rank=None) for k in sizes}
    for k, v in out.items():
        v.to_local().copy_(local[k])
    return {"model": out}


def _dcp_save(dtensors: dict, path: str):
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(dtensors, checkpoint_id=path)


def _wait(method: str, handle, started: float):
    """Wait for the save outside the timing; for tiers the seconds to each lane's end."""
    if method == "copy" or handle is None:
        return None
    if method == "dcp":
        handle.result()
        return None
    if method == "async_save":
        handle.wait()
        return None
    times = {}
    for name in ("committed", "replicated", "persisted"):
        getattr(handle, name).result()
        times[name] = time.perf_counter() - started
    return times


def _restore_job(rank: int, world: int, sizes: dict, root: dict, out: str, how: str, s3: dict | None) -> None:
    import torch.distributed as dist

    import shardckpt
    from shardckpt.tiers import CheckpointManager

    state = _state(rank, world, sizes, seed=7)
    dist.barrier()
    t = time.perf_counter()
    tiers, started = {}, None
    if how == "s3":
        shardckpt.load(state, s3["url"], storage_options=s3["options"])
        dt = time.perf_counter() - t
    else:
        run_id = "fresh" if how == "tier2" else "bench"
        with CheckpointManager(_config(root, rank, world, run_id)) as ckpt:
            started = time.perf_counter() - t  # the manager's start: its groups, its peer server
            tiers = ckpt.restore(state).tiers
            dt = time.perf_counter() - t  # (the manager's close, a training job's end, is not recovery)
    times = [None] * world
    dist.all_gather_object(times, (dt, started))
    if rank == 0:
        with open(out, "w") as f:
            starts = [s for _, s in times if s is not None]
            json.dump({"seconds": max(d for d, _ in times), "start_s": max(starts) if starts else None,
                       "tiers": tiers}, f)


def _s3_copy(rank: int, world: int, sizes: dict, s3: dict) -> None:
    import shardckpt

    state = _state(rank, world, sizes)
    shardckpt.save(state, s3["url"], storage_options=s3["options"], overwrite=True)


def recovery(sizes: dict, root: dict, s3: dict | None, repeats: int) -> dict:
    """Each case ``repeats`` times (medians), node b's tier 0 put back as the saves left it before each."""
    out, res = os.path.join(root["disk"], "restore.json"), {}
    node_b, kept = os.path.join(root["shm"], "node-b"), os.path.join(root["shm"], "node-b-kept")
    shutil.copytree(node_b, kept)
    os.sync()  # the save phase's gigabytes written back now, not while a recovery is timed

    def timed(name: str, world: int, how: str, lose_b: bool = False) -> None:
        runs = []
        for _ in range(repeats):
            shutil.rmtree(node_b, ignore_errors=True)
            None if lose_b else shutil.copytree(kept, node_b)
            drop_caches() if how == "tier2" else None
            spawn_gloo(world, _restore_job, sizes, root, out, how, s3)
            with open(out) as f:
                runs.append(json.load(f))
        starts = [r["start_s"] for r in runs if r["start_s"] is not None]
        res[name] = {"seconds": median([r["seconds"] for r in runs]), "runs": [r["seconds"] for r in runs],
                     "start_s": median(starts) if starts else None, "tiers": runs[-1]["tiers"]}
        print(f"  recovery {name:20s} {res[name]['seconds']:7.2f} s  {res[name]['runs']}  {res[name]['tiers']}",
              file=sys.stderr)

    timed("tier0", 4, "tiers")
    timed("node-lost ws4", 4, "tiers", lose_b=True)
    timed("node-lost ws2", 2, "tiers", lose_b=True)
    timed("tier2 disk cold", 4, "tier2")
    timed("tier2 disk cold ws2", 2, "tier2")  # the shrunk job's peer: the same two ranks, from disk
    if s3 is not None:
        spawn_gloo(4, _s3_copy, sizes, s3)
        timed("s3", 4, "s3")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--recovery-only", action="store_true", help="save with the tiers only, then time recovery")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--endpoint", help="an S3 endpoint on 127.0.0.1 for the S3 row (default: start moto_server), "
                    "e.g. radosgw from tests/storage/radosgw.sh")
    ap.add_argument("--key", default="k")
    ap.add_argument("--secret", default="s")
    args = ap.parse_args()
    if args.quick:
        args.gib = 0.125
    sizes = {k: (a - a % 4, b) for k, (a, b) in shapes(args.gib).items()}
    total = sum(a * b * 4 for a, b in sizes.values())
    print(f"# {total / 2**30:.3f} GiB fp32 at ws 4 as 2 nodes; load average {loadavg()}", file=sys.stderr)
    shm = tempfile.mkdtemp(prefix=f"bench-tiers-{os.getpid()}-", dir="/dev/shm")
    disk = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    root, moto = {"shm": shm, "disk": disk}, None
    try:
        runs = []
        for r in range(1 if args.recovery_only else args.repeats):
            out = os.path.join(disk, "saves.json")
            order = ("tiers",) if args.recovery_only else METHODS[r % 4:] + METHODS[:r % 4]
            spawn_gloo(4, _save_job, sizes, root, args.saves, out, order, 1 + r * args.saves)
            with open(out) as f:
                runs.append(json.load(f))
        s3 = None
        if not args.no_s3:
            endpoint = args.endpoint
            if endpoint is None:
                moto, endpoint = _start_moto(wait_s=60)  # a shared machine: moto may take a while
            assert urlsplit(endpoint).hostname == "127.0.0.1", "only 127.0.0.1 may be contacted"
            s3 = {"url": f"s3://bench-{os.getpid()}/tiers",
                  "options": {"endpoint_url": endpoint, "key": args.key, "secret": args.secret}}
            _make_bucket(s3)
        rec = recovery(sizes, root, s3, args.repeats)
        return report(total, runs, rec, args)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        if moto is not None:
            moto.kill()


def _make_bucket(s3: dict) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3["options"])
    fs.mkdir(s3["url"].split("/")[2])


def report(total: int, runs: list, rec: dict, args) -> int:
    result = {"bytes": total, "recovery": rec, "load": loadavg()}
    if not args.recovery_only:
        result.update(report_saves(total, runs))
    if args.json:
        print(json.dumps(result, indent=2))
    for name in ("tier0", "node-lost ws4", "node-lost ws2"):
        disk = rec["tier2 disk cold ws2" if name.endswith("ws2") else "tier2 disk cold"]["seconds"]
        vs_s3 = f", {rec['s3']['seconds'] / rec[name]['seconds']:.1f}x faster than S3" if "s3" in rec else ""
        print(f"recovery {name:14s} {rec[name]['seconds']:6.2f} s: {disk / rec[name]['seconds']:.1f}x faster than "
              f"tier 2 on disk (cold, same world size){vs_s3}")
    for name in [n for n in rec if n.startswith("tier2") or n == "s3"]:
        print(f"recovery {name:14s} {rec[name]['seconds']:6.2f} s")
    return 0


def report_saves(total: int, runs: list) -> dict:
    steady = {m: median([t for r in runs for t in r["blocked"][m][1:]]) for m in METHODS}
    first = {m: median([r["blocked"][m][0] for r in runs]) for m in METHODS}
    lanes = [l for r in runs for rank in r["ranks"] for l in rank["lanes"] if l]
    lane_s = {k: median([lane[k] for lane in lanes]) for k in ("committed", "replicated", "persisted")}
    moved = {k: sum(rank["moved"].get(k, 0) for rank in runs[-1]["ranks"]) for k in
             ("tier0_bytes", "replica_bytes", "uploaded_bytes")}
    print("blocked time per save (max over ranks; first call / steady state):")
    for m in METHODS:
        print(f"  {m:10s} {first[m] * 1e3:8.1f} ms  {steady[m] * 1e3:8.1f} ms")
    print(f"  tiers / async_save: {steady['tiers'] / steady['async_save']:.2f}x; dcp / tiers: "
          f"{steady['dcp'] / steady['tiers']:.1f}x")
    print(f"tiers lanes (median over saves and ranks, from the call): committed {lane_s['committed']:.2f} s, replicated {lane_s['replicated']:.2f} s, "
          f"persisted {lane_s['persisted']:.2f} s")
    print(f"bytes per save: tier 0 {moved['tier0_bytes'] / 2**20:.0f} MiB, replicas {moved['replica_bytes'] / 2**20:.0f}"
          f" MiB, uploaded {moved['uploaded_bytes'] / 2**20:.0f} MiB; async_save to disk {total / 2**20:.0f} MiB")
    return {"first_s": first, "steady_s": steady, "lanes_s": lane_s, "moved": moved}


if __name__ == "__main__":
    sys.exit(main())
