"""A throwaway Ceph radosgw (a real S3 server: 1 mon + 1 OSD + radosgw) on 127.0.0.1, for the S3 tests.

The S3 test suite runs against moto by default, and against this server when SHARDCKPT_TEST_S3=radosgw:
real-server behaviour (conditional PUTs, multipart, ranged GETs, bucket rules) that moto only imitates.
It drives ``radosgw.sh`` next to this file (``install``: apt-get the Ceph packages if missing, as root;
``up``/``down``: start/stop the daemons under a work directory). Startup takes ~15 s; credentials are fixed:

    rgw = start(str(tmp_path / "ceph"))
    try:
        s3fs.S3FileSystem(key=rgw.key, secret=rgw.secret, endpoint_url=rgw.endpoint)
    finally:
        rgw.stop()
"""
from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("radosgw.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, timeout: float) -> None:
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"radosgw.sh {' '.join(args)} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")


@dataclass
class Radosgw:
    workdir: str
    port: int
    key: str = "testkey"
    secret: str = "testsecret"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop the daemons (by their pid files) and remove the work directory."""
        _run("down", self.workdir, timeout=120)


def start(workdir: str, port: int | None = None) -> Radosgw:
    """Install Ceph if needed, start radosgw under ``workdir`` (must not exist or be empty) on ``port`` (a free
    one if None), and return once S3 answers for the test user."""
    _run("install", timeout=900)
    port = port or _free_port()
    try:
        _run("up", workdir, str(port), timeout=300)
    except subprocess.TimeoutExpired:
        _run("down", workdir, timeout=120)
        raise
    return Radosgw(workdir, port)
