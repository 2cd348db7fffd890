"""S3 transfers of one object: a streaming GET read in increasing offset order (``ObjectStream``), and a
multipart upload in bounded memory (``MultipartWriter``), both on an ``S3Storage``'s client, retries and
deadline (``io/s3.py``)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from shardckpt.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from shardckpt.io.s3 import S3Storage

MIN_PART = 5 << 20  # S3's smallest part but the last
MAX_PART = 5 << 30  # and its largest
PARTS_PER_DOUBLING = 1000  # S3 takes at most 10,000 parts: the part size doubles every 1,000 parts


class ObjectStream:
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

    def __enter__(self) -> ObjectStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):  # everything else is the storage's
        return getattr(self._s, name)


class MultipartWriter:
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
        doublings = (self._next_part - 1) // PARTS_PER_DOUBLING
        return min(self._s.tuning.part_size << doublings, MAX_PART)

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
