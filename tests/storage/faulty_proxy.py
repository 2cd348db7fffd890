"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 server (moto or radosgw), for retry tests.

Clients use the proxy's endpoint; it forwards each request unchanged (the Host header too, so SigV4
signatures still match) and, for a seeded-random fraction of requests, injects one fault instead:

- ``503``: a ``SlowDown`` answer (throttling), nothing forwarded;
- ``500``: an ``InternalError`` answer, nothing forwarded;
- ``reset``: the connection is reset before anything is forwarded;
- ``reset-after``: the request is forwarded (and takes effect), then the connection is reset before the
  answer, so the client cannot know it succeeded;
- ``cut``: the answer's headers and half its body are sent, then the connection is reset.

``script`` lists the faults (or None) of the first requests, before the random ones; ``only`` limits both to
requests whose path contains it (e.g. ``.bin``: data files); ``stop()`` (or ``stop_after``, a request count)
makes it reset every connection from then on (a server gone mid-save).
Stdlib only.
"""
from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("503", "500", "reset", "reset-after", "cut")
_ERROR_XML = ("<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected by the test proxy"
              "</Message></Error>")


class FaultyProxy:
    def __init__(self, upstream: str, rate: float = 0.0, faults: tuple[str, ...] = FAULTS, seed: int = 0,
                 script: tuple[str | None, ...] = (), stop_after: int | None = None, only: str = ""):
        self.upstream = urlsplit(upstream)
        self.rate, self.faults, self.only = rate, faults, only
        self._script, self._stop_after = list(script), stop_after
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.log: list[tuple[str, str]] = []  # (method, path) of every request, in arrival order
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopped = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        """From now on every request is answered by a reset connection (the server is gone)."""
        self._stopped = True

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _pick(self, method: str, path: str) -> str | None:
        """This request's fault (``cut`` only for a GET: a scripted one waits for the next GET)."""
        with self._lock:
            self.requests += 1
            self.log.append((method, path))
            if self._stopped or (self._stop_after is not None and self.requests > self._stop_after):
                return "stopped"
            if self.only not in path:
                return None
            if self._script:
                if self._script[0] == "cut" and method != "GET":
                    return None
                fault = self._script.pop(0)
            elif self._rng.random() >= self.rate:
                return None
            else:
                fault = self._rng.choice([f for f in self.faults if f != "cut" or method == "GET"])
            if fault is not None:
                self.injected[fault] += 1
            return fault

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        fault = self._pick(h.command, h.path)
        if fault in ("stopped", "reset"):
            _reset(h)
            return
        if fault in ("503", "500"):
            code = "SlowDown" if fault == "503" else "InternalError"
            payload = _ERROR_XML.format(code=code).encode()
            h.send_response(int(fault))
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=120)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() != "expect"}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if fault == "reset-after":
            _reset(h)
            return
        h.send_response(resp.status)
        head = h.command == "HEAD"  # its Content-Length is the object's, with no body
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "date", "server") and \
                    (head or k.lower() != "content-length"):
                h.send_header(k, v)
        if not head:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if fault == "cut":
            h.wfile.write(data[:len(data) // 2])
            h.wfile.flush()
            _reset(h)
            return
        h.wfile.write(data)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # the resets are on purpose


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed server or a middlebox would."""
    h.close_connection = True
    try:
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        h.connection.close()
    except OSError:
        pass
