"""Loopback servers for tests: moto's S3 server and a real ``mlflow server`` on sqlite."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smalti.testing.ports import free_port, wait_for_port

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    """A running S3 endpoint; ``client()`` returns a boto3 client pointed at it."""

    endpoint_url: str
    _stop: Callable[[], None] | None = field(default=None, repr=False)

    def apply_env(self) -> None:
        """Point boto3 (and smalti's S3 code) at this endpoint through the environment."""
        os.environ.update(S3_ENV)
        os.environ["S3_ENDPOINT_URL"] = self.endpoint_url

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        )

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


def start_s3_server() -> S3Server:
    """Start moto's ``ThreadedMotoServer`` on a free loopback port and point the environment at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    wait_for_port(port, timeout=30)
    server = S3Server(endpoint_url=f"http://127.0.0.1:{port}", _stop=moto.stop)
    server.apply_env()
    return server


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when the process starting it dies.

    A server started in a session of its own is out of reach of the signals that end pytest (a SIGTERM or
    SIGKILL from CI's time-out reaches pytest alone), so without this it outlives the run. The signal is sent
    when the *thread* that started the child ends: start servers from the main thread. ``None`` (no
    ``preexec_fn``) where ``prctl`` does not exist (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:  # Popen raises this in the parent
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


@dataclass
class MlflowServer:
    """A running ``mlflow server``; ``tracking_uri`` is its http address."""

    tracking_uri: str
    root: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            # The server runs in its own session with worker children: signal the whole group.
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.process = None


def start_mlflow_server(root: Path, timeout: float = 90) -> MlflowServer:
    """Start ``mlflow server`` with a sqlite store under ``root`` on a free loopback port; wait until it listens."""
    port = free_port()
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    cmd = [exe] if exe else [sys.executable, "-m", "mlflow"]
    cmd += [
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--default-artifact-root",
        (root / "artifacts").as_uri(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = open(root / "server.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
    # No background job runner (six huey consumers, each importing mlflow): tests log runs and register
    # models, which need none, and the consumers cost seconds of CPU at every start.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            preexec_fn=die_with_parent())
    server = MlflowServer(tracking_uri=f"http://127.0.0.1:{port}", root=root, process=proc)
    try:
        wait_for_port(port, timeout=timeout)
    except TimeoutError:
        server.stop()
        raise TimeoutError(
            f"mlflow server did not start in {timeout:.0f} s; its log: {(root / 'server.log').read_text()[-3000:]}"
        ) from None
    return server
