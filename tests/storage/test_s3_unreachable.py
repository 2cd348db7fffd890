"""An S3 endpoint that cannot be reached at all (connection refused, unknown host) fails within seconds with
one line naming the endpoint (it waited two minutes in silence before), while transient faults are still
retried; every retry is logged on the ``shardckpt.io`` logger as it happens (issue 35, item 5)."""
from __future__ import annotations

import logging
import socket
import time

import pytest

from shardckpt import StorageError
from shardckpt.io import open_storage
from shardckpt.io.retry import Attempts, unreachable
from tests.storage.faulty_proxy import FaultyProxy

BOUND_S = 15  # generous: the default connect_deadline_s is 3 s, on a loaded 2-core machine


def _closed_port() -> int:
    """A local port nothing listens on: bound, then closed (connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(endpoint: str, **extra) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"region_name": "us-east-1"}, **extra}


def test_a_refused_connection_fails_within_seconds_naming_the_endpoint(caplog):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    storage = open_storage("s3://bucket/x", _options(endpoint))  # the deadline is the default's, 120 s
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shardckpt.io"), pytest.raises(StorageError) as err:
        storage.exists("manifest.json")
    assert time.monotonic() - start < BOUND_S
    message = str(err.value)
    assert "\n" not in message and endpoint in message and "connection refused" in message, message
    assert "s3://bucket/x/manifest.json" in message and "connect_deadline_s" in message
    retries = [r for r in caplog.records if r.name == "shardckpt.io" and r.levelno == logging.WARNING]
    assert retries and endpoint in retries[0].getMessage() and "retry 1" in retries[0].getMessage()


def test_the_cli_says_so_in_one_line_with_exit_2(capsys):
    from shardckpt.cli.main import main

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    code = main(["inspect", "s3://bucket/x", "-o", f"endpoint_url={endpoint}", "-o", "key=testing",
                 "-o", "secret=testing", "-o", "skip_instance_cache=true"])
    assert time.monotonic() - start < BOUND_S
    *retries, err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "connection refused" in err and endpoint in err and "error" in err, err
    assert retries and all(r.startswith("shardckpt inspect: ") and "retry" in r for r in retries)  # as they happen


def test_connect_deadline_s_is_a_typed_option_and_bounded_by_retry_deadline_s():
    from shardckpt import StorageOptions, StorageTuning

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    tuning = StorageTuning(connect_deadline_s=0.5, retry_deadline_s=60)
    storage = open_storage("s3://bucket/x", StorageOptions(_options(endpoint), tuning))
    assert storage.tuning.connect_deadline_s == 0.5
    with pytest.raises(StorageError, match="connect_deadline_s=0.5 "):
        storage.exists("manifest.json")
    assert Attempts("x", "reading", deadline_s=1, connect_deadline_s=3).connect_deadline_s == 1


def test_an_unknown_host_is_unreachable_too():
    # Built, not resolved: the tests reach nothing but 127.0.0.1.
    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey
    from botocore.exceptions import EndpointConnectionError

    key = ConnectionKey("nosuch.invalid", 443, True, True, None, None, None)
    dns = aiohttp.ClientConnectorDNSError(key, socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    error = EndpointConnectionError(endpoint_url="https://nosuch.invalid:9000/bucket/x/manifest.json", error=dns)
    assert unreachable(error) == "unknown host"
    attempts = Attempts("s3://bucket/x/manifest.json", "looking up", deadline_s=120, connect_deadline_s=0.01)
    with pytest.raises(StorageError, match=r"cannot reach https://nosuch.invalid:9000 \(unknown host"):
        for attempts.tries in range(1, 5):  # the first failure starts the connect deadline's clock
            time.sleep(0.02)
            attempts.pause_after(error)


def test_transient_faults_are_still_retried_and_logged_as_they_happen(s3_bucket, caplog):
    # s3fs retries a SlowDown 5 times itself (briefly, unlogged); the 6th reaches our retries.
    server, bucket = s3_bucket
    proxy = FaultyProxy(server.endpoint, script=("503",) * 6 + ("500", "reset"))
    try:
        storage = open_storage(f"s3://{bucket}/t", server.options(endpoint_url=proxy.endpoint,
                                                                  skip_instance_cache=True))
        with caplog.at_level(logging.DEBUG, logger="shardckpt.io"):
            storage.put_atomic("a.bin", b"payload")
            storage.put_atomic("b.bin", b"more")
        assert server.raw_fs.cat_file(f"{bucket}/t/a.bin") == b"payload"
        assert server.raw_fs.cat_file(f"{bucket}/t/b.bin") == b"more"
        assert proxy.injected == {"503": 6, "500": 1, "reset": 1}
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shardckpt.io"]
        assert said and said[0][0] == logging.WARNING, said
        assert f"{bucket}/t/a.bin: writing: SlowDown (HTTP 503)" in said[0][1] and "retry 1 in" in said[0][1], said
        assert any("InternalError (HTTP 500)" in message for _, message in said), said
    finally:
        proxy.close()


def test_botocore_makes_one_attempt_per_request_so_that_every_retry_is_ours():
    from shardckpt import StorageOptions
    from shardckpt.io.s3 import S3Tuning

    _, options = S3Tuning.resolve(StorageOptions())
    assert options["config_kwargs"]["retries"] == {"total_max_attempts": 1}  # {"max_attempts": 1} retried once
