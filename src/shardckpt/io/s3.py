"""S3 (s3fs) at the raw client's speed, and safe under faults.

- Uploads are multipart: parts of ``part_size`` bytes go up ``concurrency`` at a time while the caller
  writes the next ones, so a file's memory is at most ``concurrency + 1`` parts; a file that fits in one
  part is one ``PutObject``.
- A ranged read larger than a part is split into parts fetched ``concurrency`` at a time, each streamed
  straight into its slice of the caller's buffer. A file read (nearly) whole goes through one
  whole-object GET instead (``stream``): on stores where a ranged GET costs the whole object (moto) that
  is the only fast way, and elsewhere it is one request instead of many.
- Every request is retried on throttling (503 SlowDown), 5xx, timeouts and connection resets, with
  exponential backoff and full jitter, until ``retry_deadline_s``; then a ``StorageError`` names the object.
- An exclusive put (the commit) is a conditional PUT (``If-None-Match: *``). If a retried one finds the
  object present, the object is read back: if it is the bytes this writer sent, an earlier attempt
  succeeded and the commit stands.

Knobs, from ``storage_options`` (all optional): s3fs's own ``default_block_size`` (the part size, default
8 MiB here, as boto3's) and ``max_concurrency`` (parts in flight per file, default 8), and ``retry_deadline_s``
(default 120), which shardckpt takes out before the rest goes to s3fs. botocore's own retries are
off unless ``config_kwargs`` sets them, so that a deadline bounds a request's whole retrying.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from shardckpt.errors import CheckpointError, CorruptCheckpointError, StorageConfigError, StorageError
from shardckpt.io.protocol import missing
from shardckpt.io.remote import FsspecStorage

T = TypeVar("T")

PART_SIZE = 8 << 20
CONCURRENCY = 8
RETRY_DEADLINE_S = 120.0
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.1, 5.0
_MIN_PART = 5 << 20  # S3's smallest part but the last
_MAX_PART = 5 << 30  # and its largest
_PARTS_PER_DOUBLING = 1000  # S3 takes at most 10,000 parts: the part size doubles every 1,000 parts
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "TooManyRequests", "503", "500"}


@dataclass(frozen=True)
class S3Tuning:
    part_size: int = PART_SIZE
    concurrency: int = CONCURRENCY
    retry_deadline_s: float = RETRY_DEADLINE_S

    @classmethod
    def take_from(cls, options: dict) -> S3Tuning:
        """The tuning in ``options`` (s3fs storage options), which are changed for s3fs: the keys it does
        not know are taken out, and botocore's own retries are turned off unless the caller configured
        them (``config_kwargs={"retries": ...}``), so that every retry is ours: jittered, within the deadline.
        A value of the wrong type raises ``StorageConfigError`` naming the option."""
        part = _option(options, "default_block_size", PART_SIZE, int, options.get)
        concurrency = _option(options, "max_concurrency", CONCURRENCY, int, options.get)
        deadline = _option(options, "retry_deadline_s", RETRY_DEADLINE_S, float, options.pop)
        config = options.get("config_kwargs") or {}
        if not isinstance(config, dict):
            raise StorageConfigError(f"storage option config_kwargs: expected a JSON object of botocore Config "
                                     f"arguments, got {config!r}")
        config = dict(config)
        config.setdefault("retries", {"max_attempts": 1})
        options["config_kwargs"] = config
        return cls(max(part, _MIN_PART), max(1, concurrency), deadline)


def _option(options: dict, name: str, default: float, kind: type, take: Callable) -> Any:
    """A positive, finite number option (ints for sizes and counts; bools and strings are not numbers)."""
    value = take(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (kind is int and value != int(value)):
        what = "a positive integer" if kind is int else "a positive number of seconds"
        raise StorageConfigError(f"storage option {name}: expected {what}, got {value!r}")
    return kind(value)


def _client_error(e: BaseException):
    """The botocore ClientError behind ``e`` (s3fs translates them into OSErrors), or None."""
    from botocore.exceptions import ClientError

    for err in (e, e.__cause__):
        if isinstance(err, ClientError):
            return err
    return None


def _retryable(e: BaseException) -> bool:
    """Throttling, 5xx, timeouts and broken connections; not 4xx answers (missing, denied, precondition)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, ResponseStreamingError

    client = _client_error(e)
    if client is not None:
        status = client.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or client.response.get("Error", {}).get("Code") in _THROTTLE_CODES
    import aiohttp

    return isinstance(e, (HTTPClientError, BotoConnectionError, ResponseStreamingError, aiohttp.ClientError,
                          asyncio.TimeoutError, ConnectionError, TimeoutError))


def _precondition_failed(e: BaseException) -> bool:
    if isinstance(e, FileExistsError):
        return True
    client = _client_error(e)
    return client is not None and (
        client.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict")
        or client.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412))


class S3Storage(FsspecStorage):
    """An s3fs filesystem with concurrent multipart uploads, parallel ranged reads and retries."""

    streams_whole_files = True  # the native reader streams a file it reads nearly whole (see ``stream``)

    def __init__(self, fs, root: str, protocol: str, tuning: S3Tuning):
        super().__init__(fs, root, protocol)
        self.tuning = tuning

    # -- running requests -------------------------------------------------------------------------
    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()

    def _pause_after(self, e: Exception, path: str, what: str, tries: int, start: float) -> float:
        """The pause before the next attempt after ``e`` (full jitter), or raise: ``e`` itself when it is not
        transient, a ``StorageError`` when the pause would pass the deadline."""
        if not _retryable(e):
            if isinstance(e, (OSError, CheckpointError, KeyError)):
                raise e
            # botocore's own errors (no credentials, a parameter it refuses) are not OSErrors: name the object
            raise StorageError(f"{self._display(path)}: {what} failed: {type(e).__name__}: {e}") from e
        pause = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** tries))
        if time.monotonic() + pause >= start + self.tuning.retry_deadline_s:
            raise StorageError(f"{self._display(path)}: {what} failed after {tries} attempts in "
                               f"{time.monotonic() - start:.1f} s: {type(e).__name__}: {e}") from e
        return pause

    async def _retrying(self, path: str, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` until it succeeds, a non-transient error, or the deadline; then StorageError."""
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                left = start + self.tuning.retry_deadline_s - time.monotonic()
                return await asyncio.wait_for(attempt(), max(left, 0.001))
            except Exception as e:  # noqa: BLE001 - sorted by _pause_after
                await asyncio.sleep(self._pause_after(e, path, what, tries, start))

    def _retrying_sync(self, path: str, what: str, fn: Callable[[], T]) -> T:
        """The same for s3fs's own (blocking) calls: listings and deletes."""
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted by _pause_after
                time.sleep(self._pause_after(e, path, what, tries, start))

    def is_dir(self, path: str = "") -> bool:
        """Whether any object lies under ``path/`` (one listing request; s3fs's ``isdir`` says False when
        its lookups fail)."""
        bucket, key = self._where(path)
        prefix = key.rstrip("/") + "/" if key else ""

        async def attempt() -> bool:
            resp = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
            return bool(resp.get("KeyCount") or resp.get("Contents"))

        try:
            return self._run(self._retrying(path, "listing", attempt))
        except FileNotFoundError:  # no such bucket
            return False

    def _names(self, path: str, kind: str) -> list[str]:
        return self._retrying_sync(path, "listing", lambda: super(S3Storage, self)._names(path, kind))

    def remove_dir(self, path: str) -> None:
        self._retrying_sync(path, "deleting", lambda: super(S3Storage, self).remove_dir(path))

    def remove_abandoned(self, path: str, min_age_s: float, dry_run: bool = False,
                         unused: Callable[[], bool] = lambda: True) -> bool:
        return self._retrying_sync(path, "collecting debris", lambda: super(S3Storage, self).remove_abandoned(
            path, min_age_s, dry_run, unused))

    def _where(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.url(path))
        return bucket, key

    async def _get_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from one ranged GET; a retry after a broken stream goes on where it broke."""
        bucket, key = self._where(path)
        done = 0

        async def attempt() -> None:
            nonlocal done
            if done == len(out):
                return
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                          Range=f"bytes={offset + done}-{offset + len(out) - 1}")
            body = resp["Body"]
            try:
                while done < len(out):
                    n = await body.readinto(out[done:done + (8 << 20)])
                    if n == 0:
                        raise CorruptCheckpointError(
                            f"{self._display(path)}: file is truncated (wanted {len(out)} bytes at offset "
                            f"{offset}, got {done})")
                    done += n
            finally:
                body.close()

        await self._retrying(path, f"reading {len(out)} bytes at offset {offset}", attempt)

    # -- reads -----------------------------------------------------------------------------------
    def _head(self, path: str) -> int | None:
        """The object's size, or None where there is none: one HEAD, retried by the policy above (s3fs's
        ``exists``/``size`` retry by their own rules and may fall back to listings)."""
        bucket, key = self._where(path)

        async def attempt() -> int | None:
            try:
                resp = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            return int(resp["ContentLength"])

        return self._run(self._retrying(path, "looking up", attempt))

    def exists(self, path: str) -> bool:
        return self._head(path) is not None

    def file_size(self, path: str) -> int:
        size = self._head(path)
        if size is None:
            raise missing(self._display(path), FileNotFoundError(self.url(path)))
        return size

    def read_bytes(self, path: str) -> bytes:
        bucket, key = self._where(path)

        async def attempt() -> bytes:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        return self._guard(path, lambda: self._run(self._retrying(path, "reading", attempt)))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        part = self.tuning.part_size

        async def run() -> None:
            gate = asyncio.Semaphore(self.tuning.concurrency)  # made in the loop that uses it

            async def one(lo: int) -> None:
                async with gate:
                    await self._get_into(path, offset + lo, out[lo:lo + part])

            await asyncio.gather(*(one(lo) for lo in range(0, len(out), part)))

        self._guard(path, lambda: self._run(run()))

    def _guard(self, path: str, fn: Callable[[], T]) -> T:
        """A definite answer that the bytes are not there (404, 416: s3fs raises OSErrors) is the protocol's
        ``missing``; a store that kept failing stays a ``StorageError``."""
        try:
            return fn()
        except StorageError:
            raise
        except (OSError, KeyError) as e:
            raise missing(self._display(path), e) from e

    def stream(self, path: str, start: int, stop: int) -> "_Stream":
        """A reader of bytes ``[start, stop)`` of ``path`` from one streaming GET, for reads in increasing
        offset order (``read_into``); anything else falls back to ranged GETs."""
        return _Stream(self, path, start, stop)

    # -- writes ----------------------------------------------------------------------------------
    def open_writer(self, path: str) -> "_MultipartWriter":
        return _MultipartWriter(self, path)

    def put_atomic(self, path: str, data: bytes, exclusive: bool = False) -> None:
        bucket, key = self._where(path)
        match = {"IfNoneMatch": "*"} if exclusive else {}

        async def attempt() -> None:
            await self.fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, **match)

        try:
            self._run(self._retrying(path, "writing", attempt))
        except OSError as e:
            if not _precondition_failed(e):
                raise
            # An earlier attempt (ours, or a retry inside botocore) may have landed before the connection
            # broke: then the object holds exactly our bytes (a manifest names its own generation).
            if self._current(path) == data:
                return
            raise FileExistsError(self._display(path)) from e
        finally:
            self.fs.invalidate_cache()

    def _current(self, path: str) -> bytes | None:
        try:
            return self.read_bytes(path)
        except CorruptCheckpointError:
            return None


class _Stream:
    """``read_into`` over one file for reads in increasing offset order, served by one streaming GET of
    ``[start, stop)`` (a gap is read and dropped; a read behind the stream is a ranged GET of its own)."""

    _SKIP = 1 << 20

    def __init__(self, storage: S3Storage, path: str, start: int, stop: int):
        self._s, self._path, self._pos, self._stop = storage, path, start, stop
        self._body = None

    async def _open(self):
        bucket, key = self._s._where(self._path)
        resp = await self._s.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                         Range=f"bytes={self._pos}-{self._stop - 1}")
        return resp["Body"]

    async def _fill(self, out: memoryview) -> None:
        """Fill ``out`` from the stream at ``self._pos``; a broken stream is reopened where it broke."""
        done = 0

        async def attempt() -> None:
            nonlocal done
            if self._body is None:
                self._body = await self._open()
            try:
                while done < len(out):
                    n = await self._body.readinto(out[done:done + (8 << 20)])
                    if n == 0:
                        raise CorruptCheckpointError(f"{self._s._display(self._path)}: file is truncated "
                                                     f"(ended before offset {self._pos + 1})")
                    done += n
                    self._pos += n
            except BaseException:
                self._close_body()
                raise

        await self._s._retrying(self._path, f"reading at offset {self._pos}", attempt)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        if path != self._path or offset < self._pos or offset + len(out) > self._stop:
            self._s.read_into(path, offset, out)
            return
        skip = offset - self._pos
        if skip > 0:
            scratch = memoryview(bytearray(min(skip, self._SKIP)))
            while self._pos < offset:
                self._s._guard(self._path, lambda: self._s._run(self._fill(scratch[:offset - self._pos])))
        self._s._guard(self._path, lambda: self._s._run(self._fill(out)))

    def _close_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._close_body()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):  # everything else is the storage's
        return getattr(self._s, name)


class _MultipartWriter:
    """Sequential writes, uploaded as parts ``concurrency`` at a time (memory: ``concurrency + 1`` parts);
    a file smaller than one part is one PutObject on ``close``. Any failure aborts the upload."""

    positional = False

    def __init__(self, storage: S3Storage, path: str):
        self._s, self._path = storage, path
        self._bucket, self._key = storage._where(path)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._inflight: list = []  # concurrent futures of the parts being uploaded, oldest first
        self._etags: dict[int, str] = {}
        self._next_part = 1
        self._size = 0  # bytes written

    def _part_size(self) -> int:
        doublings = (self._next_part - 1) // _PARTS_PER_DOUBLING
        return min(self._s.tuning.part_size << doublings, _MAX_PART)

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        self._size += len(data)
        try:
            while len(data):
                room = self._part_size() - len(self._buf)
                self._buf += data[:room]
                data = data[room:]
                if len(self._buf) == self._part_size():
                    self._send_part()
        except BaseException:
            self._abort()
            raise

    def _send_part(self) -> None:
        if self._upload_id is None:
            async def create() -> str:
                resp = await self._s.fs._call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
                return resp["UploadId"]

            self._upload_id = self._s._run(self._s._retrying(self._path, "starting the upload", create))
        while len(self._inflight) >= self._s.tuning.concurrency:
            self._inflight.pop(0).result()  # bounded memory: wait for the oldest part
        number, body = self._next_part, self._buf
        self._next_part, self._buf = number + 1, bytearray()

        async def upload() -> None:
            resp = await self._s.fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key, Body=body,
                                             PartNumber=number, UploadId=self._upload_id)
            self._etags[number] = resp["ETag"]

        self._inflight.append(asyncio.run_coroutine_threadsafe(
            self._s._retrying(self._path, f"uploading part {number}", upload), self._s.fs.loop))

    def close(self) -> None:
        try:
            if self._upload_id is None:
                body = bytes(self._buf)

                async def put() -> None:
                    await self._s.fs._call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=body)

                self._s._run(self._s._retrying(self._path, "writing", put))
                return
            if self._buf:
                self._send_part()
            for f in self._inflight:
                f.result()
            self._inflight = []
            parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]

            async def complete() -> None:
                try:
                    await self._s.fs._call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                                              UploadId=self._upload_id, MultipartUpload={"Parts": parts})
                except FileNotFoundError:  # NoSuchUpload: did an attempt whose answer was lost complete it?
                    if self._size == 0 or await self._landed_size() != self._size:
                        raise

            self._s._run(self._s._retrying(self._path, "completing the upload", complete))
        except BaseException:
            self._abort()
            raise
        finally:
            self._s.fs.invalidate_cache()

    async def _landed_size(self) -> int | None:
        try:
            resp = await self._s.fs._call_s3("head_object", Bucket=self._bucket, Key=self._key)
        except FileNotFoundError:
            return None
        return int(resp["ContentLength"])

    def _abort(self) -> None:
        """Best effort: wait for the parts in flight, then abort the upload so that its parts are freed."""
        for f in self._inflight:
            f.cancel()
        self._inflight = []
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._s._run(asyncio.wait_for(self._s.fs._call_s3(
                "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id), 10))
        except Exception:  # noqa: BLE001 - the store's lifecycle rules or `shardckpt gc` clean up
            pass
