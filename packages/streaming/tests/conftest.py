"""Package-local fixtures: a small dataset writer and a fault-injecting proxy in front of the loopback S3 server."""

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import pytest

from smalti.streaming import MDSWriter


def write_dataset(path, n=1003, size_limit=2000, compression="zstd"):
    with MDSWriter(path, {"id": "int", "x": "ndarray:float32:4"}, compression=compression, hashes=["xxh64"],
                   size_limit=size_limit) as writer:
        for i in range(n):
            writer.write({"id": i, "x": np.full(4, i, np.float32)})
    return path


@pytest.fixture
def make_dataset():
    """``make_dataset(path, n=..., size_limit=..., compression=...)`` writes an ``id``/``x`` MDS dataset."""
    return write_dataset


@pytest.fixture
def dataset_dir(tmp_path):
    return write_dataset(tmp_path / "data")


class FaultyProxy:
    """Forwards HTTP to an S3 endpoint, injecting faults into shard GETs.

    Every ``fail_every``-th shard GET answers 500; every ``stall_every``-th one first stalls ``stall_s``
    seconds (longer than the client's time-out, to force a retry; :meth:`stop` ends a stall early); the
    others are delayed ``delay_s``. ``gets`` counts the shard GETs per path, ``stalled`` lists the paths of
    stalled GETs and ``gets_while_stalled`` counts GETs of a path that arrived while a GET of it was stalled.
    """

    def __init__(self, target: str, fail_every: int = 0, delay_s: float = 0.0, stall_every: int = 0,
                 stall_s: float = 0.0) -> None:
        self.target = urlparse(target)
        self.fail_every, self.delay_s = fail_every, delay_s
        self.stall_every, self.stall_s = stall_every, stall_s
        self.requests = 0
        self.failures = 0
        self.stalls = 0
        self.gets: Counter[str] = Counter()
        self.stalled: list[str] = []
        self.gets_while_stalled: Counter[str] = Counter()
        self._stalling: Counter[str] = Counter()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET" and ".mds" in self.path:
                    path = self.path.split("?")[0]
                    with proxy._lock:
                        proxy.requests += 1
                        n = proxy.requests
                        proxy.gets[path] += 1
                        if proxy._stalling[path]:
                            proxy.gets_while_stalled[path] += 1
                    if proxy.fail_every and n % proxy.fail_every == 1:
                        proxy.failures += 1
                        self.send_response(500)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    if proxy.stall_every and n % proxy.stall_every == 1:
                        with proxy._lock:
                            proxy.stalls += 1
                            proxy.stalled.append(path)
                            proxy._stalling[path] += 1
                        proxy._stopped.wait(proxy.stall_s)
                        with proxy._lock:
                            proxy._stalling[path] -= 1
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.target.netloc
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that gave up on a stalled answer closed its socket: expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self._stopped.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_proxy(s3_server, monkeypatch):
    """``s3_proxy(**faults)`` puts a :class:`FaultyProxy` in front of the loopback S3 server for this test."""
    proxies = []

    def start(**faults):
        proxy = FaultyProxy(s3_server.endpoint_url, **faults)
        proxies.append(proxy)
        monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()


@pytest.fixture
def faulty_s3(s3_proxy):
    return s3_proxy(fail_every=2, delay_s=0.02)


@pytest.fixture
def upload_dataset(s3_server, s3_bucket):
    """``upload_dataset(local_dir, prefix)`` copies a dataset to the test bucket; returns its ``s3://`` URL."""

    def upload(path, prefix="ds"):
        client = s3_server.client()
        for file in path.iterdir():
            client.upload_file(str(file), s3_bucket, f"{prefix}/{file.name}")
        return f"s3://{s3_bucket}/{prefix}"

    return upload
