"""Loopback emulators for Google Cloud Storage (``gcp-storage-emulator``) and Azure Blob (Azurite).

Each is a real server in a child process on a free loopback port, polled until it answers, stopped by the
fixture that started it. Clients find them through ``STORAGE_EMULATOR_HOST`` and
``AZURE_STORAGE_CONNECTION_STRING`` (see :meth:`GcsServer.env` and :meth:`AzuriteServer.env`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from smalti.testing.ports import free_port

# Azurite's published development account (the same for every Azurite install; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_HOME_ENV = "SMALTI_AZURITE"  # path of an ``azurite-blob`` executable, overriding the search


def _terminate(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, what: str, timeout: float) -> None:
    """Poll ``url`` until the server answers any HTTP status; fail with its log if it dies or times out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} at start; its log:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered, with an error status: it is up
        except OSError:
            pass
        if time.monotonic() > deadline:
            _terminate(proc)
            raise TimeoutError(f"{what} did not answer on {url} within {timeout:.0f} s; its log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


@dataclass
class GcsServer:
    """A running ``gcp-storage-emulator``; ``endpoint`` is its http address."""

    endpoint: str
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def env(self) -> dict[str, str]:
        """Environment that points google-cloud-storage (and smalti-storage) at this emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GOOGLE_CLOUD_PROJECT": "smalti-test"}

    def client(self):  # noqa: ANN201 - google.cloud.storage.Client, imported lazily
        """A google-cloud-storage client for this emulator, to set up buckets in tests."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="smalti-test", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.endpoint}
        )

    def stop(self) -> None:
        _terminate(self.process)
        self.process = None


def start_gcs_server(root: Path, timeout: float = 60) -> GcsServer:
    """Start ``gcp-storage-emulator start --in-memory`` on a free loopback port; wait until it answers."""
    port = free_port()
    exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "gcp_storage_emulator"]
    cmd += ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    log = root / "gcs-emulator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    server = GcsServer(endpoint=f"http://127.0.0.1:{port}", process=proc)
    _wait_http(f"{server.endpoint}/storage/v1/b?project=smalti-test", proc, log, "gcp-storage-emulator", timeout)
    return server


def find_azurite(start: Path | None = None) -> str | None:
    """The ``azurite-blob`` executable: ``$SMALTI_AZURITE``, a project-local ``.tools/azurite`` above ``start``
    (where ``scripts/setup.sh`` installs it), or ``PATH``."""
    if os.environ.get(AZURITE_HOME_ENV):
        return os.environ[AZURITE_HOME_ENV]
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        exe = folder / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
        if exe.exists():
            return str(exe)
    return shutil.which("azurite-blob")


@dataclass
class AzuriteServer:
    """A running Azurite blob service; ``blob_endpoint`` is ``http://127.0.0.1:P/devstoreaccount1``."""

    blob_endpoint: str
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def connection_string(self, blob_endpoint: str | None = None) -> str:
        """The connection string of the development account at this server (or at ``blob_endpoint``)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={blob_endpoint or self.blob_endpoint};"
        )

    def env(self) -> dict[str, str]:
        """Environment that points azure-storage-blob (and smalti-storage) at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def client(self):  # noqa: ANN201 - azure.storage.blob.BlobServiceClient, imported lazily
        """A ``BlobServiceClient`` for this server, to set up containers in tests."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def stop(self) -> None:
        _terminate(self.process)
        self.process = None


def start_azurite(root: Path, exe: str, timeout: float = 60) -> AzuriteServer:
    """Start ``azurite-blob`` (data under ``root``) on a free loopback port; wait until it answers."""
    port = free_port()
    data = root / "azurite-data"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
           "--loose", "--skipApiVersionCheck", "--silent"]
    log = root / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    server = AzuriteServer(blob_endpoint=f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", process=proc)
    _wait_http(f"{server.blob_endpoint}?comp=list", proc, log, "Azurite", timeout)
    return server
