"""S3 save and load against the raw client and torch DCP, side by side in one run (issue 12).

Workload: ``--mib`` MiB of fp32 state (16 MiB tensors), in one process (world size 1).

Methods, their order rotating from repeat to repeat, each timed in-process (medians over ``--repeats``):

- ``raw put``: the faster of boto3's multipart ``upload_fileobj`` (8 MiB parts, 10 threads) and one
  ``put_object`` of the same bytes (both are timed and shown; the faster is the limit);
- ``raw get``: the faster of ``download_fileobj`` (8 MiB ranged GETs, 10 threads) and one ``get_object``;
- ``shardckpt save`` / ``load`` over ``s3://`` (load into preallocated tensors, checksums verified);
- ``dcp save`` / ``load``: ``torch.distributed.checkpoint`` with its ``FsspecWriter``/``FsspecReader``.

Every save goes to a fresh key, removed after each repeat. The S3 server is moto's (``moto_server`` started here on 127.0.0.1 in its
own process), or any S3 endpoint given with ``--endpoint`` (e.g. radosgw from ``tests/storage/radosgw.sh``).
Only 127.0.0.1 is ever contacted.

    python benchmarks/bench_s3.py --mib 256 --mib 1024                     # moto
    bash tests/storage/radosgw.sh install && bash tests/storage/radosgw.sh up /tmp/rgw 7480
    python benchmarks/bench_s3.py --endpoint http://127.0.0.1:7480 --key testkey --secret testsecret
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


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(4 * MiB, generator=g) for i in range(max(1, mib // 16))}


def run(endpoint: str, key: str, secret: str, sizes: list[int], repeats: int, tuning: dict) -> list[dict]:
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
                          region_name="us-east-1", config=botocore.config.Config(max_pool_connections=16))
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    options = {"endpoint_url": endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}
    tuned = {**options, **tuning}  # shardckpt's knobs (dcp and the raw client get their own defaults)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    transfer = TransferConfig(multipart_chunksize=8 * MiB, multipart_threshold=8 * MiB, max_concurrency=10)
    rows = []
    for mib in sizes:
        state = _state(mib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        blob = b"".join(t.numpy().tobytes() for t in state.values())
        times: dict[str, list[float]] = {}
        peak: list[int] = []

        def timed(name: str, fn) -> None:
            t = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t)

        def method_raw_put(tag: str) -> None:
            timed("raw put_object", lambda: client.put_object(Bucket=bucket, Key=f"raw/{tag}/a", Body=blob))
            timed("raw multipart", lambda: client.upload_fileobj(io.BytesIO(blob), bucket, f"raw/{tag}/b",
                                                                 Config=transfer))

        def method_raw_get(tag: str) -> None:
            timed("raw get_object", lambda: client.get_object(Bucket=bucket, Key=f"raw/{tag}/a")["Body"].read())
            timed("raw ranged", lambda: client.download_fileobj(bucket, f"raw/{tag}/b", io.BytesIO(),
                                                                Config=transfer))

        def method_shardckpt(tag: str) -> None:
            url = f"s3://{bucket}/shardckpt/{tag}"
            with RssSampler() as rss:
                timed("shardckpt save", lambda: shardckpt.save(state, url, storage_options=tuned))
            peak.append(rss.delta)
            target = {k: torch.empty_like(v) for k, v in state.items()}
            timed("shardckpt load", lambda: shardckpt.load(target, url, storage_options=tuned))
            assert all(torch.equal(target[k], state[k]) for k in state)

        def method_dcp(tag: str) -> None:
            url = f"s3://{bucket}/dcp/{tag}"
            timed("dcp save", lambda: dcp.save(state, storage_writer=FsspecWriter(url, **options)))
            target = {k: torch.empty_like(v) for k, v in state.items()}
            timed("dcp load", lambda: dcp.load(target, storage_reader=FsspecReader(url, **options)))
            assert all(torch.equal(target[k], state[k]) for k in state)

        methods = [method_raw_put, method_raw_get, method_shardckpt, method_dcp]
        for r in range(repeats):
            tag = uuid.uuid4().hex[:8]
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            if order.index(method_raw_get) < order.index(method_raw_put):  # get reads what put wrote
                order.remove(method_raw_get)
                order.insert(order.index(method_raw_put) + 1, method_raw_get)
            for m in order:
                m(tag)
            for prefix in ("raw", "shardckpt", "dcp"):  # the server may hold objects in memory (moto)
                fs.rm(f"{bucket}/{prefix}/{tag}", recursive=True)
        med = {k: median(v) for k, v in times.items()}
        raw_put = min(med["raw put_object"], med["raw multipart"])
        raw_get = min(med["raw get_object"], med["raw ranged"])
        mbps = {k: nbytes / v / 1e6 for k, v in med.items()}
        rows.append({"mib": nbytes // MiB, "seconds": med, "MB/s": mbps,
                     "save vs raw": raw_put / med["shardckpt save"], "load vs raw": raw_get / med["shardckpt load"],
                     "dcp save vs raw": raw_put / med["dcp save"], "dcp load vs raw": raw_get / med["dcp load"],
                     "shardckpt save peak RSS delta MiB": median(peak) / MiB})
        print(f"\n{nbytes // MiB} MiB, median of {repeats} (load average {loadavg()}):")
        for k in sorted(med):
            print(f"  {k:16s} {med[k]:7.3f} s  {mbps[k]:7.1f} MB/s")
        print(f"  shardckpt save / raw: {rows[-1]['save vs raw']:.0%}, load / raw: {rows[-1]['load vs raw']:.0%}; "
              f"dcp save / raw: {rows[-1]['dcp save vs raw']:.0%}, load / raw: {rows[-1]['dcp load vs raw']:.0%}; "
              f"shardckpt save peak RSS +{rows[-1]['shardckpt save peak RSS delta MiB']:.0f} MiB")
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
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        os.environ.pop(k, None)
    os.environ.update({"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    proc = None
    endpoint = args.endpoint
    if endpoint is None:
        proc, endpoint = _start_moto()
    try:
        tuning = {k: v for k, v in (("default_block_size", args.part_mib and args.part_mib * MiB),
                                    ("max_concurrency", args.concurrency)) if v}
        rows = run(endpoint, args.key, args.secret, args.mib or [256, 1024], args.repeats, tuning)
    finally:
        if proc is not None:
            proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"endpoint": "moto" if proc else endpoint, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
