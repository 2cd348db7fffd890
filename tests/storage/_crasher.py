"""Crash-consistency trials, run as a script by tests/storage/test_crash_suite.py (one process imports torch
once; each trial is a forked child that SIGKILLs itself mid-operation).

    python tests/storage/_crasher.py ROOT TRIALS_PER_OPERATION SEED [s3]   -> prints one JSON line of counts

For each operation (save at ws 1 and ws 2, async_save, convert, export), a committed "old" output exists at
the destination; a child then overwrites it with a "new" one and is killed at a random point, half the
trials by bytes written (a random threshold below the operation's total), half by time (a random delay below
its duration). Then: the destination must hold exactly the old output (verified), or exactly the new one if
the child finished first; nothing partial may load as committed; and rerunning the operation must succeed.
With ``s3``, save and async_save write to a moto S3 server on 127.0.0.1 instead (its debris goes by age,
so what a killed save left is not counted there).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardckpt
from shardckpt import ShardedTensor
from shardckpt.checkpoint.verify import verify
from shardckpt.io import open_storage
from shardckpt.offline.convert import convert
from shardckpt.offline.export import export
from shardckpt.io import direct, local, remote, s3_transfer

OPERATIONS = ("save ws1", "save ws2", "async_save", "convert", "export")
S3_OPERATIONS = ("save ws1 (s3)", "async_save (s3)")
S3: dict = {}  # url and storage options of the destination, once the server runs


def state(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {"model": {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g).bfloat16()},
            "optim": {"exp_avg": torch.randn(256, 1024, generator=g)}, "step": version}


def _kill_after_bytes(threshold: int) -> None:
    """From now on in this process, SIGKILL once ``threshold`` bytes have been written (local files or
    object uploads: bytes handed to the S3 writer, whose parts are then in flight)."""
    written = [0]
    real_local, real_remote = local._LocalWriter.pwrite, remote._FsspecWriter.write
    real_s3, real_direct = s3_transfer.MultipartWriter.write, direct.DirectWriter.write

    def counted(data, write) -> None:
        data = memoryview(data).cast("B")
        left = threshold - written[0]
        if left < len(data):
            write(data[:max(left, 0)])
            os.kill(os.getpid(), signal.SIGKILL)
        written[0] += len(data)
        write(data)

    local._LocalWriter.pwrite = lambda self, data, offset: counted(data, lambda d: real_local(self, d, offset))
    direct.DirectWriter.write = lambda self, data: counted(data, lambda d: real_direct(self, d))
    remote._FsspecWriter.write = lambda self, data: counted(data, lambda d: real_remote(self, d))
    s3_transfer.MultipartWriter.write = lambda self, data: counted(data, lambda d: real_s3(self, d))


def _kill_after(seconds: float) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()


def _save_ws2(path: str, version: int, store_dir: str, kill: tuple[str, float] | None) -> None:
    """Two forked ranks (gloo over a FileStore) save; the first to die takes the other with it."""
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                if kill is not None and rank == int(kill[1] * 10) % 2:
                    (_kill_after_bytes if kill[0] == "bytes" else _kill_after)(kill[1])
                store = dist.FileStore(os.path.join(store_dir, "store"), 2)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
                sd = state(version)
                sd["model"]["w"] = ShardedTensor.from_full(sd["model"]["w"], rank, 2)
                shardckpt.save(sd, path, overwrite=True)
                dist.destroy_process_group()
                os._exit(0)
            except BaseException:  # noqa: BLE001 - a rank whose peer died
                os._exit(3)
        pids.append(pid)
    _, status = os.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in pids[1:]:
        try:
            os.wait()
        except ChildProcessError:
            break
    os._exit(0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 9)


def run(op: str, root: str, version: int, kill: tuple[str, float] | None) -> None:
    """Run ``op`` writing ``version`` to its destination (in this process: a forked child)."""
    src, dst = os.path.join(root, f"src-{version}"), os.path.join(root, "dst")
    if op == "save ws2":
        shutil.rmtree(os.path.join(root, "store"), ignore_errors=True)
        os.makedirs(os.path.join(root, "store"))
        _save_ws2(dst, version, os.path.join(root, "store"), kill)
    if kill is not None:
        (_kill_after_bytes if kill[0] == "bytes" else _kill_after)(kill[1])
    if op == "save ws1":
        shardckpt.save(state(version), dst, overwrite=True)
    elif op == "save ws1 (s3)":
        shardckpt.save(state(version), S3["url"], overwrite=True, storage_options=S3["options"])
    elif op == "async_save (s3)":
        shardckpt.async_save(state(version), S3["url"], overwrite=True, storage_options=S3["options"]).wait()
    elif op == "async_save":
        shardckpt.async_save(state(version), dst, overwrite=True).wait()
    elif op == "convert":
        convert(src, dst, world_size=3, overwrite=True)
    elif op == "export":
        export(src, dst, overwrite=True)


def holds(op: str, root: str, version: int) -> bool:
    """Whether the destination holds exactly ``version``'s output, complete and verified."""
    dst = os.path.join(root, "dst")
    want = state(version)
    try:
        if op == "export":
            got = load_file(os.path.join(dst, "model.safetensors"))
            return set(got) == set(want["model"]) and all(torch.equal(got[k], v) for k, v in want["model"].items())
        if op.endswith("(s3)"):
            got = shardckpt.load_full(S3["url"], storage_options=S3["options"])
            return verify(open_storage(S3["url"], S3["options"])).ok and got["step"] == version and \
                torch.equal(got["model"]["w"], want["model"]["w"])
        got = shardckpt.load_full(dst)
        return verify(dst).ok and got["step"] == version and torch.equal(got["model"]["w"], want["model"]["w"]) \
            and torch.equal(got["optim"]["exp_avg"], want["optim"]["exp_avg"])
    except Exception:  # noqa: BLE001 - anything but the exact output is a failure of the trial
        return False


def _in_child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return status


def _tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    return sum(_tensor_bytes(v) for v in tree.values()) if isinstance(tree, dict) else 0


def start_s3() -> None:
    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"})
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
    fsspec.filesystem("s3", **options).call_s3("create_bucket", Bucket="crash-suite")
    S3.update(url="s3://crash-suite/ckpt", options=options)


def trials(root: str, n: int, seed: int, operations: tuple[str, ...] = OPERATIONS) -> dict:
    rng = random.Random(seed)
    for version in (1, 2):
        shardckpt.save(state(version), os.path.join(root, f"src-{version}"))
    counts = {}
    for op in operations:
        c = counts[op] = {"trials": 0, "killed": 0, "old intact": 0, "finished first": 0, "partial visible": 0,
                          "rerun ok": 0, "data lost": 0, "debris left": 0}
        shutil.rmtree(os.path.join(root, "dst"), ignore_errors=True)
        start = time.perf_counter()
        assert _in_child(lambda: run(op, root, 1, None)) == 0 and holds(op, root, 1), op
        duration = time.perf_counter() - start
        total = _tensor_bytes(state(1)) if op.endswith("(s3)") else \
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "dst")) for f in fs)
        for t in range(n):
            kill = ("bytes", rng.uniform(0, total)) if t % 2 == 0 else ("seconds", rng.uniform(0, duration))
            status = _in_child(lambda: run(op, root, 2, kill))
            c["trials"] += 1
            killed = not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
            if killed:
                c["killed"] += 1
                if holds(op, root, 1):
                    c["old intact"] += 1
                elif holds(op, root, 2):
                    c["finished first"] += 1  # the commit landed before the kill did
                else:
                    c["data lost"] += 1
            elif holds(op, root, 2):
                c["finished first"] += 1
            else:
                c["partial visible"] += 1
            # Rerun: the new version, to completion; then back to the old one for the next trial.
            if _in_child(lambda: run(op, root, 2, None)) == 0 and holds(op, root, 2):
                c["rerun ok"] += 1
            assert _in_child(lambda: run(op, root, 1, None)) == 0 and holds(op, root, 1), op
            if not op.endswith("(s3)"):
                c["debris left"] += len(_debris(os.path.join(root, "dst")))
    return counts


def _debris(dst: str) -> list[str]:
    """What a killed run left that two completed runs since have not removed."""
    keep = {"manifest.json", "model.safetensors"}
    if os.path.exists(os.path.join(dst, "manifest.json")):
        keep.add(f"data-{json.loads(open(os.path.join(dst, 'manifest.json'), 'rb').read())['generation']}")
    return [e for e in os.listdir(dst) if e not in keep]


if __name__ == "__main__":
    torch.set_num_threads(1)
    on_s3 = sys.argv[4:] == ["s3"]
    if on_s3:
        start_s3()
    print(json.dumps(trials(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), S3_OPERATIONS if on_s3 else OPERATIONS)),
          flush=True)
