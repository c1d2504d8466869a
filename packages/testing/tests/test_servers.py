"""Servers started by fixtures die with the process that started them, even when it is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from smalti.testing.torchrun import group_members

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# Stands in for pytest: starts a sleeper in its own session as the server fixtures do, prints its pid, waits.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from smalti.testing.servers import die_with_parent
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                             preexec_fn=die_with_parent())
    print(child.pid, flush=True)
    time.sleep(120)
""")


def wait_gone(pgid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_child_in_its_own_session_dies_when_its_starter_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert group_members(child) == [child]
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(child, timeout=10) == []
    finally:
        if group_members(child):
            os.killpg(child, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)
