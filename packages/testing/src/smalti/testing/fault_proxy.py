"""An HTTP proxy on loopback that forwards to a real server (moto, the GCS emulator, Azurite) and injects faults.

Two kinds of fault: a *brown-out* (every request answers ``status``, 503 by default, for ``seconds``), and
*rules* (requests of one method whose path contains a string fail, a number of times or always). Every
request is recorded as ``(method, path, status)`` so a test can check what reached the store and when.
The upstream's absolute ``Location`` headers (resumable uploads) are rewritten to go through the proxy too.

    proxy = start_fault_proxy(s3_server.endpoint_url)
    proxy.brown_out(3.0)          # the next 3 s of requests get 503
    ...
    proxy.stop()
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "content-length", "host"}
_ERROR_BODY = b"<?xml version='1.0'?><Error><Code>ServiceUnavailable</Code><Message>injected fault</Message></Error>"


@dataclass
class Rule:
    """Fail ``method`` requests whose path contains ``contains`` with ``status`` (``times`` times, or always)."""

    method: str
    contains: str
    times: int | None
    status: int = 500


@dataclass
class FaultProxy:
    """A running proxy; ``url`` is its address, to use instead of the upstream's."""

    upstream: str
    url: str = ""
    rules: list[Rule] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _outage_until: float = 0.0
    _outage_status: int = 503
    _outage_min_left: int = 0
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def brown_out(self, seconds: float, status: int = 503, min_failures: int = 0) -> None:
        """From now on, for ``seconds``, answer every request with ``status`` (the store is overloaded).

        ``min_failures`` keeps it going past ``seconds`` until that many requests have been refused, so a
        test on a slow machine still sees its clients meet the outage.
        """
        with self.lock:
            self._outage_until = time.monotonic() + seconds
            self._outage_status = status
            self._outage_min_left = min_failures

    def fail(self, method: str, contains: str, times: int | None = None, status: int = 500) -> None:
        """Answer ``status`` to ``method`` requests whose path contains ``contains`` (``times`` times, or always)."""
        with self.lock:
            self.rules.append(Rule(method.upper(), contains, times, status))

    def clear(self) -> None:
        """End the brown-out and drop every rule."""
        with self.lock:
            self.rules.clear()
            self._outage_until = 0.0
            self._outage_min_left = 0

    def failed(self) -> list[tuple[str, str, int]]:
        """The requests that got an injected (or upstream) status of 500 or more."""
        with self.lock:
            return [r for r in self.requests if r[2] >= 500]

    def _fault(self, method: str, path: str) -> int | None:
        with self.lock:
            if time.monotonic() < self._outage_until or self._outage_min_left > 0:
                self._outage_min_left = max(0, self._outage_min_left - 1)
                return self._outage_status
            for rule in self.rules:
                if rule.method == method and rule.contains in path and (rule.times is None or rule.times > 0):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule.status
        return None

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(proxy.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response(status)
            for key, value in headers:
                if key.lower() in _HOP:
                    continue
                if key.lower() == "location":
                    value = value.replace(proxy.upstream.rstrip("/"), proxy.url)
                self.send_header(key, value)
            upstream_length = next((v for k, v in headers if k.lower() == "content-length"), None)
            # a HEAD answer carries the object's length but no body
            length = upstream_length if self.command == "HEAD" and upstream_length else str(len(body))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self) -> None:
            body = self._body()
            status = proxy._fault(self.command, self.path)
            if status is not None:
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, status))
                self._reply(status, [("Content-Type", "application/xml")], _ERROR_BODY)
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP | {"expect"}}
                headers["Host"] = target.netloc
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, resp.status))
                self._reply(resp.status, resp.getheaders(), data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up on an answer closed its socket: expected under injected faults


def start_fault_proxy(upstream: str) -> FaultProxy:
    """Start a :class:`FaultProxy` on a free loopback port in front of ``upstream`` (``http://host:port``)."""
    proxy = FaultProxy(upstream=upstream.rstrip("/"))
    server = _Server(("127.0.0.1", 0), _handler(proxy))
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    proxy._server = server
    proxy._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
    proxy._thread.start()
    return proxy
