"""``run_process_group`` on time-out leaves nothing running, also processes in sessions of their own (as
torchrun starts its workers)."""

import os
import subprocess
import sys
import time

import pytest

from smalti.testing.torchrun import run_process_group

# The launcher starts a "worker" in a new session, prints its pid, and waits as a hung agent would.
LAUNCHER = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
    "print(w.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_time_out_kills_workers_in_their_own_sessions():
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_process_group([sys.executable, "-c", LAUNCHER], timeout=3)
    worker = int(info.value.output.split()[0])
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)
