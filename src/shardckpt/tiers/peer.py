"""The peer server: every node serves its tier 0, read-only, over TCP to its peers, which read it as a
``Storage`` (``PeerStorage``): replication pulls a peer's files through it, and a restore reads a lost node's
files from the replicas its peers hold.

Requests are one JSON line (``{"t": token, "op": ..., "path": ..., "off": ..., "len": ...}``); the answer is
a 9-byte header (status byte, payload length) then the payload, a file range sent with ``sendfile``. Only
paths below a ``step-*`` directory, of segments ``[A-Za-z0-9_.-]``, no ``..``, no ``.part-`` or ``.tmp-`` names,
are served; a request without the job's token is refused."""
from __future__ import annotations

import json
import os
import re
import socket
import socketserver
import struct
import threading

from shardckpt.errors import CheckpointError, CorruptCheckpointError

_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]+$")
_HEADER = struct.Struct("!BQ")
OK, MISSING, REFUSED = 0, 1, 2
MAX_LINE = 4096


def servable(path: str) -> bool:
    """Whether ``path`` may be served: relative, below a ``step-*`` directory, plain segments, no partial files."""
    parts = path.split("/")
    if not path or len(parts) < 1 or not parts[0].startswith("step-"):
        return False
    return all(_SEGMENT.match(p) and p not in (".", "..") and ".part-" not in p and ".tmp-" not in p for p in parts)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn, server = self.request, self.server
        reader = conn.makefile("rb")
        while True:
            line = reader.readline(MAX_LINE)
            if not line:
                return
            try:
                req = json.loads(line)
            except ValueError:
                return
            if not isinstance(req, dict) or req.get("t") != server.token:
                conn.sendall(_HEADER.pack(REFUSED, 0))
                return
            self._answer(conn, server.root, req)

    def _answer(self, conn: socket.socket, root: str, req: dict) -> None:
        path, op = req.get("path", ""), req.get("op")
        if not isinstance(path, str) or not (servable(path) or (op in ("dirs", "files") and path == "")):
            conn.sendall(_HEADER.pack(REFUSED, 0))
            return
        full = os.path.join(root, path)
        try:
            if op == "size":
                conn.sendall(_HEADER.pack(OK, os.stat(full).st_size))
            elif op in ("dirs", "files"):
                keep = os.path.isdir if op == "dirs" else os.path.isfile
                names = sorted(n for n in os.listdir(full) if keep(os.path.join(full, n)) and ".part-" not in n)
                body = json.dumps(names).encode()
                conn.sendall(_HEADER.pack(OK, len(body)) + body)
            elif op == "read":
                self._send_range(conn, full, int(req["off"]), int(req["len"]))
            else:
                conn.sendall(_HEADER.pack(REFUSED, 0))
        except (OSError, KeyError, ValueError):
            conn.sendall(_HEADER.pack(MISSING, 0))

    @staticmethod
    def _send_range(conn: socket.socket, full: str, offset: int, length: int) -> None:
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if offset < 0 or length < 0 or offset + length > size:
                conn.sendall(_HEADER.pack(MISSING, 0))
                return
            conn.sendall(_HEADER.pack(OK, length))
            sent = 0
            while sent < length:
                n = os.sendfile(conn.fileno(), f.fileno(), offset + sent, length - sent)
                if n == 0:
                    raise OSError("file shrank while sent")
                sent += n


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class PeerServer:
    """Serves ``root`` (a run's tier-0 directory) on ``host:port`` (port 0: the OS picks) in a daemon thread."""

    def __init__(self, root: str, token: str, host: str = "127.0.0.1", port: int = 0):
        os.makedirs(root, exist_ok=True)
        self._server = _Server((host, port), _Handler)
        self._server.root, self._server.token = root, token
        self.address = (host, self._server.server_address[1])
        # polled every 50 ms for ``close`` (socketserver's default 0.5 s held every manager's close that long)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="shardckpt-peer-server",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def default_peer_host() -> str:
    """Where a node serves its peers when ``peer_host`` is None: the address of its interface towards the job's
    rendezvous (``MASTER_ADDR``), the route its peers' traffic takes too; 127.0.0.1 without one."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # a datagram socket sends nothing on connect: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class PeerStorage:
    """A peer's tier-0 directory ``prefix`` (a step directory) as a read-only ``Storage``, one connection per
    thread. A peer that does not answer within ``timeout_s`` raises ``CorruptCheckpointError`` (the copy is then
    unusable, as a damaged one is)."""

    streams_whole_files = False

    def __init__(self, address: tuple[str, int], token: str, prefix: str, timeout_s: float = 60.0):
        self.address, self.token, self.prefix, self.timeout_s = tuple(address), token, prefix.strip("/"), timeout_s
        self.root = f"peer://{address[0]}:{address[1]}/{self.prefix}"
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()

    def url(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _conn(self) -> tuple[socket.socket, object]:
        held = getattr(self._local, "conn", None)
        if held is None:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            held = self._local.conn = (sock, sock.makefile("rb"))
            with self._lock:
                self._all.append(sock)
        return held

    def _ask(self, op: str, path: str, into: memoryview | None = None, **more) -> tuple[int, bytes | int]:
        full = f"{self.prefix}/{path}" if path else self.prefix
        try:
            sock, reader = self._conn()
            sock.sendall(json.dumps({"t": self.token, "op": op, "path": full, **more}).encode() + b"\n")
            status, length = _HEADER.unpack(_read_exactly(reader, _HEADER.size))
            if op == "size" or status != OK:
                return status, length
            if into is None:
                return status, _read_exactly(reader, length)
            _read_into(reader, into, length)
            return status, length
        except (OSError, struct.error, EOFError) as e:
            self._drop()
            raise CorruptCheckpointError(f"{self.url(path)}: peer unreachable ({type(e).__name__}: {e})") from e

    def _drop(self) -> None:
        held = getattr(self._local, "conn", None)
        self._local.conn = None
        if held is not None:
            try:
                held[0].close()
            except OSError:
                pass

    def _ok(self, status: int, path: str) -> None:
        if status == REFUSED:
            raise CheckpointError(f"{self.url(path)}: the peer refused the request")
        if status != OK:
            raise CorruptCheckpointError(f"{self.url(path)}: file missing or unreadable at the peer")

    def exists(self, path: str) -> bool:
        return self._ask("size", path)[0] == OK

    def file_size(self, path: str) -> int:
        status, size = self._ask("size", path)
        self._ok(status, path)
        return int(size)

    def read_bytes(self, path: str) -> bytes:
        size = self.file_size(path)
        out = bytearray(size)
        self.read_into(path, 0, memoryview(out))
        return bytes(out)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        status, _ = self._ask("read", path, into=out, off=offset, len=len(out))
        self._ok(status, path)

    def list_files(self, path: str = "") -> list[str]:
        status, body = self._ask("files", path)
        return json.loads(body) if status == OK else []

    def list_dirs(self, path: str = "") -> list[str]:
        status, body = self._ask("dirs", path)
        return json.loads(body) if status == OK else []

    def is_dir(self, path: str = "") -> bool:
        return bool(self.list_dirs(path) or self.list_files(path))

    def pin(self, paths: list[str]) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            for sock in self._all:
                try:
                    sock.close()
                except OSError:
                    pass
            self._all.clear()
        self._local = threading.local()

    def _read_only(self, *args, **kwargs):
        raise CheckpointError(f"{self.root}: a peer's tier 0 is read-only")

    open_writer = put_atomic = remove_dir = hold_dir = remove_abandoned = sync_dir = _read_only


def _read_exactly(reader, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise EOFError(f"connection closed after {len(data)} of {n} bytes")
    return data


def _read_into(reader, out: memoryview, length: int) -> None:
    if length != len(out):
        raise EOFError(f"the peer sent {length} bytes, {len(out)} were asked")
    done = 0
    while done < length:
        n = reader.readinto(out[done:])
        if not n:
            raise EOFError(f"connection closed after {done} of {length} bytes")
        done += n
