"""Tier 2 runner: the Triton kernels under ``TRITON_INTERPRET=1`` in a child pytest, so the setting stays there.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when :mod:`smalti.moe.triton_kernels`
is first imported; setting it in this process would switch the interpreter on for every later test of a
whole-suite run (and do nothing if Triton kernels were already imported). A fresh process avoids both.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TIER2 = Path(__file__).with_name("tier2_triton_kernels.py")


@pytest.mark.timeout(600)
def test_triton_kernels_under_interpreter(request):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", str(TIER2), "-q", "--no-header", "-p", "no:cacheprovider",
           f"--rootdir={request.config.rootpath}", "-o", "timeout=300"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"tier 2 (interpreter) failed:\n{report}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report
    print(proc.stdout.strip().splitlines()[-1])  # the child's summary, shown with -rP
