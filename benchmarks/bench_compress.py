"""Compressed vs uncompressed checkpoints, side by side in one process (issue 13).

Workload: transformer-shaped weights initialised as N(0, 0.02) (embedding, per layer attention q/k/v/o
and MLP up/down), ``--mib`` MiB of bf16 and, separately, of fp32.

For each dtype, interleaved within each repeat:

- ``raw``: ``shardckpt.save`` (uncompressed, format v2) / cold ``shardckpt.load`` into preallocated tensors;
- ``zstd``: ``shardckpt.save(compress="zstd")`` (zstd level 1, byte planes, format v3) / cold load.

Saves fsync (shardckpt always does). Before each save the output is removed and the page cache dropped,
and before each load the page cache is dropped (root only). Throughput is logical bytes (the tensors'
size) per second. Reported: on-disk size ratio, save and cold-load MB/s, medians of ``--repeats``.

Partial read: rows ``[1000, 1000 + rows/16)`` of one 64 MiB bf16 tensor of the compressed checkpoint,
through a storage that counts the data-file bytes read, against the tensor's stored bytes.

S3 through a slow link: the bf16 weights saved to moto's S3 server on 127.0.0.1 through a TCP proxy
that limits client-to-server bytes to ``--link-mbps`` MB/s, raw vs compressed (median of the repeats).

    python benchmarks/bench_compress.py              # 256 MiB each, 3 repeats, S3 at 40 MB/s
    python benchmarks/bench_compress.py --quick      # 64 MiB, 1 repeat
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import Timer, can_drop_caches, drop_caches, loadavg, median, remove, verdict

import shardckpt
from shardckpt.formats.native import NativeReader, read_manifest
from shardckpt.formats.api import ReadRequest
from shardckpt.io.local import LocalStorage

MB = 1e6


def weights(mib: int, dtype: torch.dtype) -> dict:
    """Layers of [1024 x 4096]-shaped matrices until ``mib`` MiB, plus one [4096 x 8192] bf16-sized tensor."""
    g = torch.Generator().manual_seed(0)
    out, total, i = {}, 0, 0
    budget = mib << 20
    while total < budget:
        shape = (1024, 4096) if i % 3 else (4096, 1024)
        t = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        out[f"layers.{i}.weight"] = t
        total += t.nbytes
        i += 1
    return out


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_local(sd: dict, root: str, repeats: int) -> dict:
    logical = sum(t.nbytes for t in sd.values())
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    times = {m: {"save": [], "load": []} for m in ("raw", "zstd")}
    sizes = {}
    for r in range(repeats):
        for method in (("raw", "zstd") if r % 2 == 0 else ("zstd", "raw")):
            path = os.path.join(root, method)
            remove(path)
            drop_caches()
            with Timer() as t:
                shardckpt.save(sd, path, compress="zstd" if method == "zstd" else None)
            times[method]["save"].append(t.s)
            sizes[method] = _du(path)
            drop_caches()
            with Timer() as t:
                shardckpt.load(targets, path)
            times[method]["load"].append(t.s)
            assert all(torch.equal(targets[k], sd[k]) for k in sd), method
    out = {"logical_bytes": logical}
    for m in times:
        out[m] = {"bytes": sizes[m], "save_s": median(times[m]["save"]), "load_s": median(times[m]["load"]),
                  "save_MBps": logical / median(times[m]["save"]) / MB,
                  "load_MBps": logical / median(times[m]["load"]) / MB}
    out["size_ratio"] = sizes["raw"] / sizes["zstd"]
    return out


class _Counting(LocalStorage):
    read = 0

    def read_into(self, path, offset, buf):
        if path.endswith(".bin"):
            type(self).read += len(buf)
        return super().read_into(path, offset, buf)


def bench_partial(root: str) -> dict:
    rows, cols = 4096, 8192  # 64 MiB of bf16
    full = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    path = os.path.join(root, "partial")
    remove(path)
    shardckpt.save({"w": full}, path, compress="zstd")
    storage = _Counting(path)
    stored = sum(f.size for f in read_manifest(storage).files)
    n = rows // 16
    dest = torch.empty(n, cols, dtype=torch.bfloat16)
    _Counting.read = 0
    NativeReader(storage, read_manifest(storage)).read([ReadRequest("w", shardckpt.Box((1000, 0), (n, cols)),
                                                                    dest.reshape(-1))])
    assert torch.equal(dest, full[1000:1000 + n])
    return {"tensor_bytes": full.nbytes, "stored_bytes": stored, "read_bytes": _Counting.read,
            "read_fraction_of_stored": _Counting.read / stored}


class _Throttle:
    """A TCP proxy on 127.0.0.1 that passes client-to-server bytes at ``rate`` bytes/s in all (one link)."""

    def __init__(self, upstream: tuple[str, int], rate: float):
        self.upstream, self.rate = upstream, rate
        self.lock = threading.Lock()
        self.next_free = time.monotonic()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while data := src.recv(64 << 10):
                if throttled:
                    with self.lock:  # reserve this chunk's time on the shared link
                        start = max(self.next_free, time.monotonic())
                        self.next_free = start + len(data) / self.rate
                    time.sleep(max(0.0, self.next_free - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def bench_s3(sd: dict, link_mbps: float, repeats: int) -> dict:
    import logging

    from moto.server import ThreadedMotoServer

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"})
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = _Throttle((host, port), link_mbps * MB)
    options = {"endpoint_url": f"http://127.0.0.1:{proxy.port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
    import fsspec

    fsspec.filesystem("s3", **options).call_s3("create_bucket", Bucket="bench")
    logical = sum(t.nbytes for t in sd.values())
    times = {"raw": [], "zstd": []}
    try:
        for r in range(repeats):
            for method in (("raw", "zstd") if r % 2 == 0 else ("zstd", "raw")):
                with Timer() as t:
                    shardckpt.save(sd, f"s3://bench/{method}-{r}", storage_options=options,
                                   compress="zstd" if method == "zstd" else None)
                times[method].append(t.s)
    finally:
        server.stop()
    return {"link_MBps": link_mbps, "logical_bytes": logical,
            **{m: {"save_s": median(v), "save_MBps": logical / median(v) / MB} for m, v in times.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-mbps", type=float, default=40.0)
    ap.add_argument("--s3-mib", type=int, default=64, help="bf16 MiB saved through the slow link")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.repeats, args.s3_mib = 64, 1, 16
    print(f"# load average before: {loadavg()}; cold caches: {can_drop_caches()}; {os.cpu_count()} cores",
          file=sys.stderr)
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            sd = weights(args.mib, dtype)
            results[name] = bench_local(sd, root, args.repeats)
            del sd
        results["partial"] = bench_partial(root)
    results["s3"] = bench_s3(weights(args.s3_mib, torch.bfloat16), args.link_mbps, args.repeats)
    if args.json:
        print(json.dumps(results, indent=2))
    _report(results)
    return 0


def _report(r: dict) -> None:
    for name, target in (("bf16", 1.4), ("fp32", 1.15)):
        x = r[name]
        print(f"{name}: {x['logical_bytes'] / 2**20:.0f} MiB; on disk raw {x['raw']['bytes'] / 2**20:.1f} MiB, zstd "
              f"{x['zstd']['bytes'] / 2**20:.1f} MiB: {x['size_ratio']:.3f}x smaller (target >= {target}: "
              f"{verdict(x['size_ratio'] >= target)})")
        for m in ("raw", "zstd"):
            print(f"  {m:4s} save {x[m]['save_s']:.3f} s = {x[m]['save_MBps']:.0f} MB/s; cold load {x[m]['load_s']:.3f} s "
                  f"= {x[m]['load_MBps']:.0f} MB/s")
        print(f"  zstd save >= 500 MB/s: {verdict(x['zstd']['save_MBps'] >= 500)}; zstd cold load >= 800 MB/s: "
              f"{verdict(x['zstd']['load_MBps'] >= 800)}")
    p = r["partial"]
    print(f"partial: 1/16 of the rows of a 64 MiB bf16 tensor read {p['read_bytes'] / 2**20:.2f} MiB of its "
          f"{p['stored_bytes'] / 2**20:.2f} MiB stored = {p['read_fraction_of_stored']:.3f} (target <= 0.25: "
          f"{verdict(p['read_fraction_of_stored'] <= 0.25)})")
    s = r["s3"]
    print(f"S3 via a {s['link_MBps']:.0f} MB/s link, {s['logical_bytes'] / 2**20:.0f} MiB bf16: raw {s['raw']['save_s']:.2f} s, "
          f"zstd {s['zstd']['save_s']:.2f} s: {s['raw']['save_s'] / s['zstd']['save_s']:.2f}x faster compressed "
          f"({verdict(s['zstd']['save_s'] < s['raw']['save_s'])})")


if __name__ == "__main__":
    sys.exit(main())
