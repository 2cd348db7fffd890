"""Which S3 failures are worth retrying, for how long, and what a retry tells the user.

- Transient: throttling (503 SlowDown), 5xx, timeouts, a connection reset or broken mid-answer. Retried
  with exponential backoff and full jitter until ``retry_deadline_s``.
- Unreachable: the endpoint cannot be reached at all (connection refused, unknown host, no route). A
  server restarting can refuse for a moment, so these are retried too, but only for ``connect_deadline_s``
  (a few seconds) in a row: a wrong ``endpoint_url`` or a server that is down fails fast, with one line
  naming the endpoint, instead of retrying for minutes in silence.
- Everything else (a 4xx answer, no credentials, a malformed answer) is not retried.

Each retry is logged on the ``shardckpt.io`` logger: a warning for a request's first retry and then at
most one every ``_WARN_EVERY_S`` seconds (debug for the others), so that a user sees what is being retried
as it happens; the CLI prints warnings on stderr.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import time
from urllib.parse import urlsplit

from shardckpt.errors import CheckpointError, StorageError

log = logging.getLogger("shardckpt.io")

_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.1, 5.0
_WARN_EVERY_S = 10.0
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "TooManyRequests", "503", "500"}
_NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH}


def client_error(e: BaseException):
    """The botocore ClientError behind ``e`` (s3fs translates them into OSErrors), or None."""
    from botocore.exceptions import ClientError

    for err in (e, e.__cause__):
        if isinstance(err, ClientError):
            return err
    return None


def retryable(e: BaseException) -> bool:
    """Throttling, 5xx, timeouts and broken connections; not 4xx answers (missing, denied, precondition)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, ResponseStreamingError

    client = client_error(e)
    if client is not None:
        status = client.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or client.response.get("Error", {}).get("Code") in _THROTTLE_CODES
    import aiohttp

    return isinstance(e, (HTTPClientError, BotoConnectionError, ResponseStreamingError, aiohttp.ClientError,
                          asyncio.TimeoutError, ConnectionError, TimeoutError))


def _causes(e: BaseException):
    """``e`` and what lies behind it: causes, contexts, botocore's ``error=`` and aiohttp's ``os_error``."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__, getattr(err, "os_error", None),
                 (getattr(err, "kwargs", None) or {}).get("error")]


def unreachable(e: BaseException) -> str | None:
    """Why the endpoint could not be reached at all ("connection refused", "unknown host", "no route to
    host"), or None when ``e`` is something else (an answer, a timeout, a reset mid-request)."""
    for err in _causes(e):
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        if isinstance(err, socket.gaierror) or type(err).__name__ == "ClientConnectorDNSError":
            return "unknown host"
        if isinstance(err, OSError) and err.errno in _NO_ROUTE:
            return "no route to host"
    return None


def endpoint_of(e: BaseException) -> str | None:
    """The ``scheme://host:port`` that ``e`` (a botocore connection error) failed to reach, if it says."""
    for err in _causes(e):
        url = (getattr(err, "kwargs", None) or {}).get("endpoint_url")
        if isinstance(url, str):
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url
    return None


def describe(e: BaseException) -> str:
    """``e`` in a few words: an S3 answer by its code (s3fs's OSError says "[Errno 121]" of a SlowDown)."""
    client = client_error(e)
    if client is not None:
        error, meta = client.response.get("Error", {}), client.response.get("ResponseMetadata", {})
        return f"{error.get('Code', '?')} (HTTP {meta.get('HTTPStatusCode', '?')}): {error.get('Message', e)}"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return "timed out"  # asyncio.wait_for's TimeoutError says nothing
    return f"{type(e).__name__}: {e}"


class Attempts:
    """One request's attempts: when to pause and for how long, when to give up, what to log."""

    def __init__(self, where: str, what: str, deadline_s: float, connect_deadline_s: float):
        self.where, self.what = where, what
        self.deadline_s, self.connect_deadline_s = deadline_s, min(connect_deadline_s, deadline_s)
        self.start = time.monotonic()
        self.tries = 0
        self._unreachable_since: float | None = None
        self._warned_at: float | None = None

    def time_left(self) -> float:
        return max(self.start + self.deadline_s - time.monotonic(), 0.001)

    def pause_after(self, e: Exception) -> float:
        """The pause before the next attempt after ``e`` (full jitter), or raise: ``e`` itself when it is not
        transient, a ``StorageError`` when the endpoint stays unreachable or the pause would pass the deadline."""
        if not retryable(e):
            if isinstance(e, (OSError, CheckpointError)):
                raise e
            # botocore's own errors (no credentials, a parameter it refuses) and a malformed answer (a KeyError)
            # are not OSErrors: a StorageError names the object
            raise StorageError(f"{self.where}: {self.what} failed: {type(e).__name__}: {e}") from e
        now = time.monotonic()
        pause = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** self.tries))
        why = unreachable(e)
        self._unreachable_since = (self._unreachable_since or now) if why else None
        if why and now + pause >= self._unreachable_since + self.connect_deadline_s:
            endpoint = endpoint_of(e) or "the S3 endpoint"
            raise StorageError(f"{self.where}: {self.what} failed: cannot reach {endpoint} ({why}; {self.tries} "
                               f"attempts in {now - self.start:.1f} s). Check endpoint_url and the network "
                               f"(connect_deadline_s={self.connect_deadline_s:g} retries longer)") from e
        if now + pause >= self.start + self.deadline_s:
            raise StorageError(f"{self.where}: {self.what} failed after {self.tries} attempts in "
                               f"{now - self.start:.1f} s: {describe(e)}") from e
        self._log(e, why, pause, now)
        return pause

    def _log(self, e: Exception, why: str | None, pause: float, now: float) -> None:
        warn = self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S
        if warn:
            self._warned_at = now
        cause = f"cannot reach {endpoint_of(e) or 'the endpoint'} ({why})" if why else describe(e)
        log.log(logging.WARNING if warn else logging.DEBUG,
                "%s: %s: %s; retry %d in %.1f s (gives up after %g s)", self.where, self.what,
                cause, self.tries, pause, self.connect_deadline_s if why else self.deadline_s)
