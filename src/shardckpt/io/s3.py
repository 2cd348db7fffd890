"""S3 (s3fs) at the raw client's speed, and safe under faults.

- Uploads are multipart: parts of ``part_size`` bytes go up ``concurrency`` at a time while the caller
  writes the next ones, so a file's memory is at most ``concurrency + 1`` parts; a file that fits in one
  part is one ``PutObject``.
- A ranged read larger than a part is split into parts fetched ``concurrency`` at a time, each streamed
  straight into its slice of the caller's buffer. A file read (nearly) whole goes through up to
  ``concurrency`` long streaming GETs at once (``stream``, ``stream_lanes``), each over its own stretch of
  the file: as many connections as the raw client's ranged GETs, but few requests (on stores where a
  ranged GET costs the whole object, moto, that is the only fast way).
- Every request is retried on throttling (503 SlowDown), 5xx, timeouts and connection resets, with
  exponential backoff and full jitter, until ``retry_deadline_s``; an endpoint that cannot be reached at
  all (refused, unknown host) only for ``connect_deadline_s``; then a ``StorageError`` names the object
  (``io/retry.py``). Each retry is logged on the ``shardckpt.io`` logger.
- botocore hashes no bodies (no SHA256 payload signing, no CRC32 per request) unless ``config_kwargs``
  asks: shardckpt's own CRC32C covers every byte, and aiobotocore hashed on s3fs's one loop thread.
- An exclusive put (the commit) is a conditional PUT (``If-None-Match: *``). If a retried one finds the
  object present, the object is read back: if it is the bytes this writer sent, an earlier attempt
  succeeded and the commit stands.

Knobs, typed, from ``StorageOptions.tuning`` (``shardckpt.StorageTuning``, all optional): ``part_size`` (default
s3fs's own ``default_block_size`` where given, else 8 MiB, as boto3's), ``concurrency`` (parts in flight per file,
and streams per load; default s3fs's ``max_concurrency`` where given, else 8), ``retry_deadline_s`` (default
120) and ``connect_deadline_s`` (default 3). ``StorageOptions.fsspec`` goes to s3fs as given. botocore's own
retries are off unless ``config_kwargs`` sets them, so that a
deadline bounds a request's whole retrying.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from shardckpt.errors import CorruptCheckpointError, StorageConfigError, StorageError
from shardckpt.storage_options import CONNECT_DEADLINE_S, RETRY_DEADLINE_S, StorageOptions, positive
from shardckpt.io.protocol import missing
from shardckpt.io.remote import FsspecStorage
from shardckpt.io.retry import Attempts, client_error
from shardckpt.io.s3_transfer import MIN_PART, MultipartWriter, ObjectStream

T = TypeVar("T")

PART_SIZE = 8 << 20
CONCURRENCY = 8


@dataclass(frozen=True)
class S3Tuning:
    """A ``StorageTuning`` resolved for one S3 place: every field a number."""

    part_size: int = PART_SIZE
    concurrency: int = CONCURRENCY
    retry_deadline_s: float = RETRY_DEADLINE_S
    connect_deadline_s: float = CONNECT_DEADLINE_S

    @classmethod
    def resolve(cls, options: StorageOptions) -> tuple[S3Tuning, dict]:
        """The tuning of ``options`` for S3, and the keyword arguments for s3fs: a copy of ``options.fsspec``
        in which botocore's own retries are off unless the caller configured them (``config_kwargs={"retries":
        ...}``), so that every retry is ours (jittered, within the deadline), and botocore hashes no bodies. The
        part size and concurrency left unset take s3fs's own ``default_block_size`` and ``max_concurrency``
        where given (s3fs gets them too). A value of the wrong type raises ``StorageConfigError`` naming it."""
        kwargs, tuning = dict(options.fsspec), options.tuning
        part = tuning.part_size or positive("default_block_size", kwargs.get("default_block_size", PART_SIZE), int)
        concurrency = tuning.concurrency or positive("max_concurrency", kwargs.get("max_concurrency", CONCURRENCY), int)
        config = dict(_json_object(kwargs, "config_kwargs", "botocore Config arguments"))
        _json_object(kwargs, "client_kwargs", "botocore client arguments, e.g. {\"region_name\": \"eu-west-1\"}")
        config.setdefault("retries", {"total_max_attempts": 1})  # botocore's max_attempts counts retries only
        _no_botocore_hashing(config)
        kwargs["config_kwargs"] = config
        resolved = cls(max(part, MIN_PART), max(1, concurrency), tuning.retry_deadline_s, tuning.connect_deadline_s)
        return resolved, kwargs


def _no_botocore_hashing(config: dict) -> None:
    """Turn off botocore's own hashing of bodies unless the caller configured it: a SHA256 of every body it
    signs (always, over http) and a CRC32 of every upload and GET it can. aiobotocore runs both on s3fs's one
    event-loop thread, in series with every request (~10-20 % of a 1 GiB save to radosgw, issue 38).
    Integrity stays whole without them: every byte shardckpt writes is covered by its own CRC32C (manifest
    prefix, index, per-1-MiB block CRCs of every chunk), checked on every read, so a body damaged on the way
    or on the server is refused on load (tests/storage/test_s3.py::test_s3_corrupt_object_refused_on_load).
    Requests S3 requires a checksum for (DeleteObjects) still get one."""
    config.setdefault("request_checksum_calculation", "when_required")
    config.setdefault("response_checksum_validation", "when_required")
    s3 = config.get("s3")
    if s3 is None or isinstance(s3, dict):
        config["s3"] = {"payload_signing_enabled": False, **(s3 or {})}


def _json_object(options: dict, name: str, what: str) -> dict:
    """Option ``name``, which must be a dict (s3fs fails on anything else with an AttributeError)."""
    value = options.get(name) or {}
    if not isinstance(value, dict):
        raise StorageConfigError(f"storage option {name}: expected a JSON object of {what}, got {value!r}")
    return value


def _precondition_failed(e: BaseException) -> bool:
    if isinstance(e, FileExistsError):
        return True
    client = client_error(e)
    return client is not None and (
        client.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict")
        or client.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412))


class S3Storage(FsspecStorage):
    """An s3fs filesystem with concurrent multipart uploads, parallel ranged reads and retries."""

    streams_whole_files = True  # the native reader streams a file it reads nearly whole (see ``stream``)

    def __init__(self, fs, root: str, protocol: str, tuning: S3Tuning):
        super().__init__(fs, root, protocol)
        self.tuning = tuning
        self.stream_lanes = tuning.concurrency  # streams in flight per load, as ranged GETs per read

    # -- running requests -------------------------------------------------------------------------
    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()

    def _attempts(self, path: str, what: str) -> Attempts:
        return Attempts(self._display(path), what, self.tuning.retry_deadline_s, self.tuning.connect_deadline_s)

    async def _retrying(self, path: str, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` until it succeeds, a non-transient error, or the deadline; then StorageError."""
        attempts = self._attempts(path, what)
        while True:
            attempts.tries += 1
            try:
                return await asyncio.wait_for(attempt(), attempts.time_left())
            except Exception as e:  # noqa: BLE001 - sorted by Attempts.pause_after
                await asyncio.sleep(attempts.pause_after(e))

    def _retrying_sync(self, path: str, what: str, fn: Callable[[], T]) -> T:
        """The same for s3fs's own (blocking) calls: listings and deletes."""
        attempts = self._attempts(path, what)
        while True:
            attempts.tries += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted by Attempts.pause_after
                time.sleep(attempts.pause_after(e))

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
        # Uploads in flight below ``path`` are a live save's (a file being uploaded is listed only once complete:
        # its directory can look idle for as long as one big file takes): in use, whatever the listed files' age.
        return self._retrying_sync(path, "collecting debris", lambda: super(S3Storage, self).remove_abandoned(
            path, min_age_s, dry_run, lambda: unused() and not self._uploading(path)))

    def _uploading(self, path: str) -> bool:
        """Whether a multipart upload is in progress below ``path``."""
        bucket, key = self._where(path)

        async def attempt() -> bool:
            resp = await self.fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/",
                                          MaxUploads=1)
            return bool(resp.get("Uploads"))

        return self._run(self._retrying(path, "listing uploads", attempt))

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

    def stream(self, path: str, start: int, stop: int) -> ObjectStream:
        """A reader of bytes ``[start, stop)`` of ``path`` from one streaming GET, for reads in increasing
        offset order (``read_into``); anything else falls back to ranged GETs."""
        return ObjectStream(self, path, start, stop)

    # -- writes ----------------------------------------------------------------------------------
    def open_writer(self, path: str) -> MultipartWriter:
        return MultipartWriter(self, path)

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
