"""Fixtures of smalti-checkpoint's tests: a fault-injecting HTTP proxy in front of the loopback S3 server."""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "content-length", "host"}


@dataclass
class Rule:
    method: str
    contains: str
    times: int | None  # None: every matching request fails
    status: int = 500


@dataclass
class FaultProxy:
    """Forwards every request to the real S3 endpoint, except those a rule makes fail with an HTTP error.

    ``requests`` records ``(method, path, status)`` in arrival order, so tests can check what was put when.
    """

    upstream: str
    url: str = ""
    rules: list[Rule] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, method: str, contains: str, times: int | None = None, status: int = 500) -> None:
        """Answer ``status`` to ``method`` requests whose path contains ``contains`` (``times`` times, or always)."""
        with self.lock:
            self.rules.append(Rule(method.upper(), contains, times, status))

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def _fault(self, method: str, path: str) -> int | None:
        with self.lock:
            for rule in self.rules:
                if rule.method == method and rule.contains in path and (rule.times is None or rule.times > 0):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule.status
        return None


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
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            upstream_length = next((v for k, v in headers if k.lower() == "content-length"), None)
            # a HEAD answer carries the object's length but no body
            self.send_header("Content-Length", upstream_length if self.command == "HEAD" and upstream_length else str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self) -> None:
            body = self._body()
            status = proxy._fault(self.command, self.path)
            if status is not None:
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, status))
                error = b"<Error><Code>InternalError</Code><Message>injected fault</Message></Error>"
                self._reply(status, [("Content-Type", "application/xml")], error)
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

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


@pytest.fixture
def faulty_s3(s3_server, monkeypatch):
    """A :class:`FaultProxy` in front of the loopback S3 server; ``S3_ENDPOINT_URL`` points at the proxy."""
    proxy = FaultProxy(upstream=s3_server.endpoint_url)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
    thread.start()
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
