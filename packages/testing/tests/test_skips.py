"""With SMALTI_STRICT_SKIPS=1 a run fails on a skip no optional extra or hardware explains."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from smalti.testing.skips import STRICT_ENV, is_expected

ALLOWED = '''
import pytest

def test_needs_triton():
    pytest.skip("could not import 'triton': No module named 'triton'")

def test_gpu():
    pytest.skip("needs a CUDA GPU; none is present")

def test_passes():
    pass
'''
HARD_IN_A_TEST = '''
import pytest

def test_needs_a_hard_dependency():
    pytest.importorskip("a_hard_dependency_that_is_missing")
'''
HARD_FOR_A_MODULE = '''
import pytest

pytest.importorskip("a_module_level_dependency_that_is_missing")

def test_never_runs():
    pass
'''


def _run(folder: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    for name, body in files.items():
        (folder / name).write_text(body)
    env = {**os.environ, STRICT_ENV: "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:randomly", "-p", "no:cacheprovider",
                           str(folder), *args], capture_output=True, text=True, env=env, cwd=folder, timeout=120)


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_skip_on_a_missing_dependency_fails_the_run(tmp_path, xdist):
    files = {"test_allowed.py": ALLOWED, "test_hard.py": HARD_IN_A_TEST, "test_module.py": HARD_FOR_A_MODULE}
    result = _run(tmp_path, files, *xdist)
    assert result.returncode == 1, result.stdout
    unexpected = result.stdout.split("unexpected skips")[1].split("short test summary info")[0]
    assert "a_hard_dependency_that_is_missing" in unexpected
    assert "a_module_level_dependency_that_is_missing" in unexpected
    assert "triton" not in unexpected and "CUDA" not in unexpected


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_allowed_skips_pass(tmp_path, xdist):
    result = _run(tmp_path, {"test_allowed.py": ALLOWED}, *xdist)
    assert result.returncode == 0, result.stdout
    assert "unexpected skips" not in result.stdout and "2 skipped" in result.stdout


def test_allow_list():
    assert is_expected("could not import 'wandb': No module named 'wandb'")
    assert is_expected("needs a CUDA GPU; none is present")
    assert not is_expected("could not import 'transformers': No module named 'transformers'")
    assert not is_expected("could not import 'smalti.moe': No module named 'smalti.moe'")
