"""The pytest plugin: ``world_size`` marker, shared temp dir, loopback S3 and MLflow servers.

A test marked ``@pytest.mark.world_size(2)`` is collected as usual, but its body runs in ``n`` ranks:
the parent process re-runs the same node id under ``torchrun`` (c10d rendezvous on a free loopback port,
killed after a time-out) and the test passes when every rank passes. Inside each rank this plugin has
already started a gloo process group and destroys it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from smalti.testing.cloud_servers import (
    AzuriteServer,
    GcsServer,
    find_azurite,
    start_azurite,
    start_gcs_server,
)
from smalti.testing.fault_proxy import FaultProxy, start_fault_proxy
from smalti.testing.servers import MlflowServer, S3Server, start_mlflow_server, start_s3_server
from smalti.testing.skips import STRICT_ENV, unexpected
from smalti.testing.torchrun import run_process_group, torchrun_command

IN_RANK_ENV = "SMALTI_TEST_IN_RANK"
SHARED_TMP_ENV = "SMALTI_TEST_SHARED_TMP"
DEFAULT_DIST_TIMEOUT = 240.0


def _world_size(item: pytest.Item) -> int:
    marker = item.get_closest_marker("world_size")
    if marker is None:
        return 1
    return int(marker.args[0]) if marker.args else int(marker.kwargs.get("n", 1))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "world_size(n, timeout=240): run the test body in n torchrun ranks")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where none is present")
    # --import-mode=importlib names a test module after its path from the rootdir
    # (packages.health.tests.test_cordon). A multiprocessing "spawn" child unpickles functions of that module
    # by this name, with the parent's sys.path: run from inside packages/health, the rootdir is not on it and
    # the child fails with "No module named 'packages'". Appended, so it never shadows an installed module.
    root = str(config.rootpath)
    if root not in sys.path:
        sys.path.append(root)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is present"))


def _skips(reporter: pytest.TerminalReporter) -> list[tuple[str, str]]:
    """``(where, reason)`` of every skipped test or module the run reported."""
    out = []
    for report in reporter.stats.get("skipped", []):
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            path, line, reason = longrepr
            out.append((f"{report.nodeid or path}:{line}", str(reason).removeprefix("Skipped: ")))
    return out


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``SMALTI_STRICT_SKIPS=1``, a skip that no optional extra or hardware explains fails the run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    worker = hasattr(session.config, "workerinput")  # xdist: the controller sees every report
    if not os.environ.get(STRICT_ENV) or reporter is None or worker or os.environ.get(IN_RANK_ENV):
        return
    found = unexpected(_skips(reporter))
    if not found:
        return
    reporter.section("unexpected skips (a missing dependency? see smalti.testing.skips)", red=True)
    for where, reason in found:
        reporter.write_line(f"{where}: {reason}")
    if session.exitstatus == 0:
        session.exitstatus = 1


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """In the parent process, run a multi-rank test under torchrun instead of calling it here."""
    n = _world_size(pyfuncitem)
    if n <= 1 or os.environ.get(IN_RANK_ENV):
        return None
    marker = pyfuncitem.get_closest_marker("world_size")
    timeout = float(marker.kwargs.get("timeout", DEFAULT_DIST_TIMEOUT))
    env = {
        **os.environ,
        IN_RANK_ENV: "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    shared = getattr(pyfuncitem, "_smalti_shared_tmp", None)
    if shared is not None:
        env[SHARED_TMP_ENV] = str(shared)
    rootdir = pyfuncitem.config.rootpath
    cmd = torchrun_command(n) + [
        "-m",
        "pytest",
        pyfuncitem.nodeid,
        "-q",
        "-x",
        "--no-header",
        "-p",
        "no:cacheprovider",
        f"--rootdir={rootdir}",
        "-o",
        f"timeout={int(timeout)}",
    ]
    try:
        proc = run_process_group(cmd, env=env, cwd=rootdir, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = f"{exc.output or ''}{exc.stderr or ''}"[-6000:]
        pytest.fail(f"{n}-rank run of {pyfuncitem.nodeid} hung for {timeout:.0f} s and was killed:\n{out}", pytrace=False)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(
            f"{n}-rank run of {pyfuncitem.nodeid} failed (exit {proc.returncode}):\n{output[-12000:]}",
            pytrace=False,
        )
    if "passed" not in output and "skipped" in output:
        pytest.skip(f"skipped in the {n}-rank run: {output[-500:]}")
    return True


@pytest.fixture(autouse=True)
def _smalti_rank_process_group(request: pytest.FixtureRequest) -> Iterator[None]:
    """Inside a torchrun rank, give a ``world_size`` test a gloo process group and tear it down after."""
    if not (os.environ.get(IN_RANK_ENV) and _world_size(request.node) > 1):
        yield
        return
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that every rank of a ``world_size`` test sees as the same path (``tmp_path`` differs per rank)."""
    if os.environ.get(IN_RANK_ENV) and os.environ.get(SHARED_TMP_ENV):
        return Path(os.environ[SHARED_TMP_ENV])
    path = tmp_path_factory.mktemp("shared")
    request.node._smalti_shared_tmp = path
    return path


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 endpoint (moto's server) on a free loopback port for the session; env points boto3 at it.

    Inside the ranks of a ``world_size`` test the parent's server is reused, so all ranks see the same buckets.
    """
    existing = os.environ.get("SMALTI_TEST_S3_ENDPOINT")
    if existing:
        server = S3Server(endpoint_url=existing, _stop=None)
        server.apply_env()
        yield server
        return
    pytest.importorskip("moto", reason="moto[server] is needed for the loopback S3 endpoint")
    server = start_s3_server()
    os.environ["SMALTI_TEST_S3_ENDPOINT"] = server.endpoint_url
    try:
        yield server
    finally:
        os.environ.pop("SMALTI_TEST_S3_ENDPOINT", None)
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket on the loopback S3 server, named after the test (same name on every rank)."""
    import hashlib

    name = "t-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:20]
    client = s3_server.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` with a sqlite backend on a free loopback port, for the session."""
    pytest.importorskip("mlflow", reason="mlflow is needed for the MLflow server fixture")
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.stop()



def _bucket_name(request: pytest.FixtureRequest) -> str:
    import hashlib

    return "t-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:20]


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """A real ``gcp-storage-emulator`` (in memory) on a free loopback port for the session.

    Tests point clients at it with ``monkeypatch.setenv`` over ``gcs_server.env()`` (``STORAGE_EMULATOR_HOST``).
    """
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is needed for the loopback GCS server")
    server = start_gcs_server(tmp_path_factory.mktemp("gcs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(gcs_server: GcsServer, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the loopback GCS emulator, named after the test; the environment points at it."""
    for key, value in gcs_server.env().items():
        monkeypatch.setenv(key, value)
    name = _bucket_name(request)
    client = gcs_server.client()
    if client.lookup_bucket(name) is None:
        client.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[AzuriteServer]:
    """A real Azurite blob service on a free loopback port for the session (data in a temp folder).

    Found as ``$SMALTI_AZURITE``, ``.tools/azurite`` (installed there by scripts/setup.sh) or on ``PATH``.
    """
    exe = find_azurite(pytestconfig.rootpath)
    if exe is None:
        pytest.skip("Azurite is not installed: run scripts/setup.sh (npm install --prefix .tools/azurite azurite)")
    server = start_azurite(tmp_path_factory.mktemp("azurite"), exe)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def azure_container(azurite_server: AzuriteServer, request: pytest.FixtureRequest,
                    monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh container on the loopback Azurite, named after the test; the environment points at it."""
    for key, value in azurite_server.env().items():
        monkeypatch.setenv(key, value)
    name = _bucket_name(request)
    container = azurite_server.client().get_container_client(name)
    if not container.exists():
        container.create_container()
    return name


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """``fault_proxy(upstream_url)`` starts a :class:`FaultProxy` in front of a loopback server for this test."""
    proxies: list[FaultProxy] = []

    def start(upstream: str) -> FaultProxy:
        proxy = start_fault_proxy(upstream)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()
