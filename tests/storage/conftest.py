"""Fixtures for the storage suite: a real S3-API server on 127.0.0.1, and one `backend` fixture that runs
each test against local disk, ``memory://`` and ``s3://``.

The S3 server is moto's (in a thread) by default; with ``SHARDCKPT_TEST_S3=radosgw`` it is a single-node
Ceph radosgw (``radosgw.py``: installed with apt-get if missing, started for the session, ~35 s), so that
the same tests run against a real S3 implementation.

Nothing here reaches any address but 127.0.0.1: dummy credentials, no EC2 metadata lookups, no proxies,
no AWS config files, and every S3 client gets the local endpoint explicitly.
"""
from __future__ import annotations

import functools
import logging
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    kind: str = "moto"  # or "radosgw"
    key: str = "testing"
    secret: str = "testing"

    def options(self, **extra: Any) -> dict:
        """fsspec/s3fs storage options for this server (explicit credentials: worker processes spawned
        before the environment was set need no environment)."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret,
                "client_kwargs": {"region_name": "us-east-1"}, **extra}

    @functools.cached_property
    def raw_fs(self):
        """A private s3fs instance without listing cache, for the tests' own reads and writes."""
        import fsspec

        return fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **self.options())

    def create_bucket(self, bucket: str) -> None:
        self.raw_fs.call_s3("create_bucket", Bucket=bucket)

    def reset(self) -> None:
        """Forget every bucket (moto's reset); on radosgw, remove them with their objects."""
        if self.kind == "moto":
            import requests

            requests.post(f"{self.endpoint}/moto-api/reset", timeout=30,
                          proxies={"http": None, "https": None}).raise_for_status()
            return
        fs = self.raw_fs
        fs.invalidate_cache()
        for bucket in fs.ls("", detail=False):
            fs.rm(bucket, recursive=True)
        fs.invalidate_cache()


def _start_s3_server(tmp_dir: str):
    """(S3Server, stop function): moto in a thread, or radosgw when SHARDCKPT_TEST_S3=radosgw."""
    if os.environ.get("SHARDCKPT_TEST_S3", "moto") == "radosgw":
        from tests.storage import radosgw

        rgw = radosgw.start(os.path.join(tmp_dir, "ceph"))
        return S3Server(rgw.endpoint, "radosgw", rgw.key, rgw.secret), rgw.stop
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    return S3Server(f"http://127.0.0.1:{port}"), server.stop


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An S3 server on 127.0.0.1 (free port), for the whole session: moto, or radosgw (see above)."""
    pytest.importorskip("s3fs")
    saved = {k: os.environ.get(k) for k in (*_AWS_ENV, *_PROXY_VARS)}
    os.environ.update(_AWS_ENV)
    for k in _PROXY_VARS:
        os.environ.pop(k, None)
    server, stop = _start_s3_server(str(tmp_path_factory.mktemp("s3")))
    if server.kind != "moto":
        os.environ.update(AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret)
    try:
        yield server
    finally:
        stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on a freshly reset server; yields ``(server, bucket name)``."""
    s3_server.reset()
    bucket = f"shardckpt-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    yield s3_server, bucket
    s3_server.reset()


@dataclass
class Backend:
    """Where a test's checkpoint lives, and raw access to its files (bypassing shardckpt)."""

    kind: str  # "local" | "memory" | "s3"
    url: str  # what to pass to shardckpt.save/load
    options: dict | None  # storage_options for shardckpt
    fs: Any  # an fsspec filesystem for raw access
    root: str  # the checkpoint directory as a path of ``fs``
    base_url: str  # parent of url, for sibling checkpoints
    base_root: str

    def sibling(self, name: str) -> "Backend":
        """Another checkpoint location next to this one, on the same backend."""
        sep = "/" if self.kind != "local" else os.sep
        return Backend(self.kind, self.base_url.rstrip(sep) + sep + name, self.options, self.fs,
                       posixpath.join(self.base_root, name), self.base_url, self.base_root)

    def _p(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self._p(rel))

    def write(self, rel: str, data: bytes) -> None:
        if self.kind != "s3":
            self.fs.makedirs(posixpath.dirname(self._p(rel)), exist_ok=True)
        self.fs.pipe_file(self._p(rel), data)

    def remove(self, rel: str) -> None:
        self.fs.rm(self._p(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._p(rel))

    def files(self) -> list[str]:
        """Every file under the checkpoint directory, relative to it, sorted."""
        if not self.fs.exists(self.root):
            return []
        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix):] if p.startswith(prefix) else p
                      for p in (self.fs.find(self.root)) if not p.endswith("/"))

    def data_files(self) -> list[str]:
        return [f for f in self.files() if f.endswith(".bin")]

    def index_files(self) -> list[str]:
        return [f for f in self.files() if f.endswith(".index.json")]


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request, tmp_path) -> Backend:
    """The same test on local disk, ``memory://`` and ``s3://`` (moto on 127.0.0.1)."""
    import fsspec

    kind = request.param
    if kind == "local":
        base = str(tmp_path)
        yield Backend(kind, os.path.join(base, "ckpt"), None, fsspec.filesystem("file"),
                      os.path.join(base, "ckpt"), base, base)
    elif kind == "memory":
        fs = fsspec.filesystem("memory")
        base = f"/shardckpt-test-{uuid.uuid4().hex[:12]}"
        yield Backend(kind, f"memory://{base}/ckpt", None, fs, f"{base}/ckpt", f"memory://{base}", base)
        try:
            fs.rm(base, recursive=True)
        except FileNotFoundError:
            pass
    else:
        server, bucket = request.getfixturevalue("s3_bucket")
        yield Backend(kind, f"s3://{bucket}/ckpt", server.options(), server.raw_fs, f"{bucket}/ckpt",
                      f"s3://{bucket}", bucket)


@pytest.fixture
def local_dir(tmp_path) -> str:
    path = tmp_path / "ckpt"
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    """Fail any test here that makes this process open a network connection to anything but loopback."""
    import socket

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOOPBACK:
            raise AssertionError(f"storage tests must only reach 127.0.0.1, not {address!r}")

    def connect(sock, address):
        check(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        check(sock, address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
