"""S3 save and load against the raw client and torch DCP, side by side in one run (issue 12).

Workload: ``--mib`` MiB of fp32 state (16 MiB tensors), in one process (world size 1).

Methods, their order rotating from repeat to repeat, each timed in-process (medians over ``--repeats``):

- ``raw put``: boto3's multipart ``upload_fileobj`` with shardckpt's part size and concurrency (8 MiB, 8
  threads by default; botocore's default hashing: SHA256 payload signing over http, CRC32 per part), read
  from the state's own memory, and one ``put_object`` of the same bytes (``--no-single``: left out); the
  ratios are to the multipart (``--vs-best``: to the faster of both);
- ``raw get``: ``download_fileobj`` (ranged GETs, the same part size and threads) into preallocated memory,
  and one ``get_object``;
- ``shardckpt save`` / ``load`` over ``s3://`` (load into preallocated tensors, checksums verified);
- ``--one-stream``: also ``shardckpt load (one GET per file)``, with ``max_concurrency=1``: each data file
  read through one streaming GET, as before issue 38's parallel lanes;
- ``dcp save`` / ``load``: ``torch.distributed.checkpoint`` with its ``FsspecWriter``/``FsspecReader``
  (``--no-dcp`` leaves it out);
- ``--botocore-hashing``: also ``shardckpt save/load (botocore hashing)``, with botocore's own per-request
  SHA256 and CRC32 turned back on (shardckpt turns them off: its CRC32C covers every byte; issue 38).

CPU: the client process's CPU seconds per GiB (all its threads) beside each method, and with
``--server-pid`` (repeatable; moto's own when started here, radosgw's and its OSD's with ``--rgw-dir``) the
server's, from ``/proc/PID/stat``.

Every save goes to a fresh key, removed after each repeat. The S3 server is moto's (``moto_server`` started here on 127.0.0.1 in its
own process), or any S3 endpoint given with ``--endpoint`` (e.g. radosgw from ``tests/storage/radosgw.sh``;
``--rgw-dir`` its directory: radosgw frees removed objects only in its deferred garbage collection, so
``radosgw-admin gc process --include-all`` runs after each repeat, and 4 GiB fits an OSD of ``OSD_GIB=40``).
Memory: the state and one set of load targets (the raw GET writes into the same targets), ~2x ``--mib``.
Only 127.0.0.1 is ever contacted.

    python benchmarks/bench_s3.py --mib 256 --mib 1024                     # moto
    bash tests/storage/radosgw.sh install && OSD_GIB=40 bash tests/storage/radosgw.sh up /tmp/rgw 7480
    python benchmarks/bench_s3.py --endpoint http://127.0.0.1:7480 --key testkey --secret testsecret \
        --rgw-dir /tmp/rgw --mib 256 --mib 1024 --mib 4096 --no-single --no-dcp
"""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import RssSampler, loadavg, median

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(wait_s: float = 10.0) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(int(wait_s * 10)):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _state(mib: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat fp32 buffer of ``mib`` MiB (16 MiB at least), and the state: its 16 MiB tensors, views of it."""
    flat = torch.randn(max(1, mib // 16) * 4 * MiB, generator=torch.Generator().manual_seed(0))
    return flat, {f"layer{i}.weight": t for i, t in enumerate(flat.split(4 * MiB))}


class _Memory(io.RawIOBase):
    """A seekable file over a fixed buffer: the raw client reads its upload from, and downloads into, memory that
    is already there (as shardckpt saves from the state and loads into preallocated tensors)."""

    def __init__(self, buf: memoryview):
        self._buf, self._pos = buf.cast("B"), 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (self._pos if whence == 1 else len(self._buf) if whence == 2 else 0)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:  # one copy, as io.BytesIO's
        end = len(self._buf) if n is None or n < 0 else min(self._pos + n, len(self._buf))
        data, self._pos = bytes(self._buf[self._pos:end]), max(self._pos, end)
        return data

    def readinto(self, out) -> int:
        data = self.read(len(out))
        out[:len(data)] = data
        return len(data)

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        self._buf[self._pos:self._pos + len(data)] = data
        self._pos += len(data)
        return len(data)


def _collect_garbage(rgw_dir: str | None) -> None:
    """Have radosgw free removed objects now (it defers that), so the next repeat finds the OSD's space."""
    if rgw_dir:
        subprocess.run(["radosgw-admin", "-c", os.path.join(rgw_dir, "ceph.conf"), "gc", "process", "--include-all"],
                       check=True, capture_output=True, timeout=600)


def _rgw_pids(rgw_dir: str) -> list[int]:
    pids = []
    for name in ("rgw", "osd"):
        with open(os.path.join(rgw_dir, "pids", f"{name}.pid")) as f:
            pids.append(int(f.read()))
    return pids


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of ``pids`` (and their threads), seconds."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


BOTOCORE_HASHING = {"config_kwargs": {"request_checksum_calculation": "when_supported",
                                      "response_checksum_validation": "when_supported",
                                      "s3": {"payload_signing_enabled": True}}}


def run(endpoint: str, key: str, secret: str, sizes: list[int], repeats: int, tuning: dict,
        flags: argparse.Namespace) -> list[dict]:
    import boto3
    import botocore.config
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from boto3.s3.transfer import TransferConfig

    import shardckpt

    assert urlsplit(endpoint).hostname == "127.0.0.1", "only 127.0.0.1 may be contacted"
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                          region_name="us-east-1",  # one 1 GiB put_object on a loaded machine outlasts 60 s
                          config=botocore.config.Config(max_pool_connections=16, read_timeout=600))
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    options = {"endpoint_url": endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}
    tuned = {**options, **tuning}  # shardckpt's knobs (dcp and the raw client get their own defaults)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    part, threads = tuning.get("default_block_size", 8 * MiB), tuning.get("max_concurrency", 8)
    transfer = TransferConfig(multipart_chunksize=part, multipart_threshold=part, max_concurrency=threads)
    rows = []
    for mib in sizes:
        flat, state = _state(mib)
        nbytes = flat.numel() * flat.element_size()
        memory = memoryview(flat.numpy()).cast("B")
        landing = torch.empty_like(flat)
        targets = {k: t for k, t in zip(state, landing.split(4 * MiB))}  # every load fills these
        blob = None if flags.no_single else memory.tobytes()
        times: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        server_cpu: dict[str, list[float]] = {}
        peak: list[int] = []

        def timed(name: str, fn) -> None:
            t, c, sc = time.perf_counter(), time.process_time(), _cpu_s(flags.server_pid)
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t)
            cpu.setdefault(name, []).append(time.process_time() - c)
            server_cpu.setdefault(name, []).append(_cpu_s(flags.server_pid) - sc)

        def method_raw_put(tag: str) -> None:
            if not flags.no_single:
                timed("raw put_object", lambda: client.put_object(Bucket=bucket, Key=f"raw/{tag}/a", Body=blob))
            timed("raw multipart", lambda: client.upload_fileobj(_Memory(memory), bucket, f"raw/{tag}/b",
                                                                 Config=transfer))

        def method_raw_get(tag: str) -> None:
            if not flags.no_single:
                timed("raw get_object", lambda: client.get_object(Bucket=bucket, Key=f"raw/{tag}/a")["Body"].read())
            landing.zero_()
            timed("raw ranged", lambda: client.download_fileobj(bucket, f"raw/{tag}/b", _Memory(
                memoryview(landing.numpy())), Config=transfer))
            assert torch.equal(landing, flat)

        def method_shardckpt(tag: str, label: str = "", options: dict = tuned, load_only: str = "") -> None:
            url = f"s3://{bucket}/shardckpt/{tag}/{'hashing' if label else 'plain'}"
            if not load_only:
                with RssSampler() as rss:
                    timed("shardckpt save" + label, lambda: shardckpt.save(state, url, storage_options=dict(options)))
                if not label:
                    peak.append(rss.delta)
            landing.zero_()
            label = label or load_only
            timed("shardckpt load" + label, lambda: shardckpt.load(targets, url, storage_options=dict(options)))
            assert torch.equal(landing, flat)

        def method_shardckpt_hashing(tag: str) -> None:
            method_shardckpt(tag, " (botocore hashing)", {**tuned, **BOTOCORE_HASHING})

        def method_one_stream(tag: str) -> None:  # loads what method_shardckpt saved
            method_shardckpt(tag, options={**tuned, "max_concurrency": 1}, load_only=" (one GET per file)")

        def method_dcp(tag: str) -> None:
            url = f"s3://{bucket}/dcp/{tag}"
            timed("dcp save", lambda: dcp.save(state, storage_writer=FsspecWriter(url, **options)))
            landing.zero_()
            timed("dcp load", lambda: dcp.load(targets, storage_reader=FsspecReader(url, **options)))
            assert torch.equal(landing, flat)

        methods = [method_raw_put, method_raw_get, method_shardckpt] + [method_one_stream] * flags.one_stream + \
            [method_shardckpt_hashing] * flags.botocore_hashing + [method_dcp] * (not flags.no_dcp)
        for r in range(repeats):
            tag = uuid.uuid4().hex[:8]
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for first, then in ((method_raw_put, method_raw_get), (method_shardckpt, method_one_stream)):
                if then in order and order.index(then) < order.index(first):  # a load reads what its save wrote
                    order.remove(then)
                    order.insert(order.index(first) + 1, then)
            for m in order:
                m(tag)
            for prefix in ("raw", "shardckpt", "dcp"):  # the server may hold objects in memory (moto)
                if fs.find(f"{bucket}/{prefix}/{tag}"):
                    fs.rm(f"{bucket}/{prefix}/{tag}", recursive=True)
            _collect_garbage(flags.rgw_dir)
        med = {k: median(v) for k, v in times.items()}
        raw_put = min(med["raw put_object"], med["raw multipart"]) if flags.vs_best else med["raw multipart"]
        raw_get = min(med["raw get_object"], med["raw ranged"]) if flags.vs_best else med["raw ranged"]
        mbps = {k: nbytes / v / 1e6 for k, v in med.items()}
        gib = nbytes / (1 << 30)
        cpu_per_gib = {k: median(v) / gib for k, v in cpu.items()}
        server_per_gib = {k: median(v) / gib for k, v in server_cpu.items()}
        ratios = {f"{what} {op}{label} vs raw": (raw_put if op == "save" else raw_get) / med[f"{what} {op}{label}"]
                  for what, label in (("shardckpt", ""), ("shardckpt", " (botocore hashing)"),
                                      ("shardckpt", " (one GET per file)"), ("dcp", ""))
                  for op in ("save", "load") if f"{what} {op}{label}" in med}
        ratios = {k.replace("shardckpt ", "") if "hashing" not in k else k: v for k, v in ratios.items()}
        rows.append({"mib": nbytes // MiB, "seconds": med, "every repeat s": times, "MB/s": mbps,
                     "client CPU s/GiB": cpu_per_gib, "server CPU s/GiB": server_per_gib, **ratios,
                     "shardckpt save peak RSS delta MiB": median(peak) / MiB, "load average": loadavg()})
        print(f"\n{nbytes // MiB} MiB, median of {repeats} (load average {loadavg()}), raw: {threads} threads, "
              f"{part // MiB} MiB parts:")
        for k in sorted(med):
            print(f"  {k:36s} {med[k]:7.3f} s  {mbps[k]:7.1f} MB/s  client CPU {cpu_per_gib[k]:5.2f} s/GiB"
                  f"  server CPU {server_per_gib[k]:5.2f} s/GiB")
        print("  " + ", ".join(f"{k}: {v:.0%}" for k, v in ratios.items()) +
              f"; shardckpt save peak RSS +{rows[-1]['shardckpt save peak RSS delta MiB']:.0f} MiB")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, action="append", help="state size in MiB (repeatable; default 256 and 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--endpoint", help="an S3 endpoint on 127.0.0.1 (default: start moto_server)")
    ap.add_argument("--key", default="testing")
    ap.add_argument("--secret", default="testing")
    ap.add_argument("--part-mib", type=int, help="shardckpt's part size (storage option default_block_size)")
    ap.add_argument("--concurrency", type=int, help="shardckpt's parts in flight per file (max_concurrency)")
    ap.add_argument("--no-dcp", action="store_true", help="leave torch DCP out")
    ap.add_argument("--botocore-hashing", action="store_true",
                    help="also shardckpt with botocore's own SHA256/CRC32 on (as before issue 38)")
    ap.add_argument("--no-single", action="store_true", help="leave one put_object / get_object out (server space)")
    ap.add_argument("--vs-best", action="store_true", help="ratios to the faster of multipart and one put/get")
    ap.add_argument("--one-stream", action="store_true",
                    help="also shardckpt's load with one GET per data file (max_concurrency=1, as before issue 38)")
    ap.add_argument("--server-pid", type=int, action="append", default=[], help="a server process to count CPU of")
    ap.add_argument("--rgw-dir", help="radosgw.sh's directory: count its radosgw and OSD CPU, collect its garbage "
                                      "after each repeat")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        os.environ.pop(k, None)
    os.environ.update({"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    proc = None
    endpoint = args.endpoint
    if args.rgw_dir:
        args.server_pid += _rgw_pids(args.rgw_dir)
    if endpoint is None:
        proc, endpoint = _start_moto()
        args.server_pid.append(proc.pid)
    try:
        tuning = {k: v for k, v in (("default_block_size", args.part_mib and args.part_mib * MiB),
                                    ("max_concurrency", args.concurrency)) if v}
        rows = run(endpoint, args.key, args.secret, args.mib or [256, 1024], args.repeats, tuning, args)
    finally:
        if proc is not None:
            proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"endpoint": "moto" if proc else endpoint, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
