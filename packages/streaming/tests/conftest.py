"""Package-local fixtures: a small dataset writer and a fault-injecting proxy in front of the loopback S3 server."""

import http.client
import threading
import time
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
    """Forwards HTTP to an S3 endpoint; every ``fail_every``-th shard GET answers 500, others may be delayed."""

    def __init__(self, target: str, fail_every: int = 2, delay_s: float = 0.0) -> None:
        self.target = urlparse(target)
        self.fail_every, self.delay_s = fail_every, delay_s
        self.requests = 0
        self.failures = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                is_shard = self.command == "GET" and ".mds" in self.path
                if is_shard:
                    proxy.requests += 1
                    if proxy.fail_every and proxy.requests % proxy.fail_every == 1:
                        proxy.failures += 1
                        self.send_response(500)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty_s3(s3_server, monkeypatch):
    proxy = FaultyProxy(s3_server.endpoint_url, fail_every=2, delay_s=0.02)
    monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
    yield proxy
    proxy.stop()
