"""The ``mlflow_server`` fixture's server (its own session: CLI, uvicorn) dies with the pytest that started it,
even when that pytest is SIGKILLed and never runs the fixture's teardown (a CI time-out)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from smalti.testing.torchrun import group_members  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# What the session fixture does, in a process of its own that this test can SIGKILL.
STARTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from smalti.testing.servers import start_mlflow_server
    server = start_mlflow_server(Path(sys.argv[1]))
    print(server.process.pid, flush=True)
    time.sleep(300)
""")


def test_mlflow_server_is_gone_soon_after_its_starter_is_sigkilled(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), (tmp_path / "server.log").read_text()[-3000:]
        server = int(line)
        assert len(group_members(server)) >= 2  # the mlflow CLI and the uvicorn it runs
        starter.kill()
        starter.wait(timeout=10)
        deadline = time.monotonic() + 30
        while (left := group_members(server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"still running 30 s after their starter died: {left}"
    finally:
        if server and group_members(server):
            os.killpg(server, signal.SIGKILL)
        starter.kill()
        starter.wait(timeout=10)
