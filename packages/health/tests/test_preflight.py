"""Preflight: a cordoned or failing node refuses to join with exit 93; smalti-launch passes the code on."""

import subprocess
import sys

from smalti.health.cordon import add_to_cordon, is_cordoned
from smalti.health.preflight import DO_NOT_RESTART_EXIT, run_preflight

HEALTHY = {"name": "NVIDIA H100 80GB HBM3", "recovery": 0}


def _preflight(*args, env=None):
    return subprocess.run([sys.executable, "-m", "smalti.health.cli", "preflight", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_a_cordoned_host_refuses_with_the_do_not_restart_code(tmp_path):
    cordon = str(tmp_path / "cordon.json")
    add_to_cordon(cordon, "node-7", "XID 79 on gpu2")
    out = _preflight("--cordon", cordon, "--host", "node-7")
    assert out.returncode == DO_NOT_RESTART_EXIT == 93
    assert "node-7 is cordoned" in out.stdout and "XID 79 on gpu2" in out.stdout
    assert "Traceback" not in out.stderr


def test_a_healthy_cpu_host_joins(tmp_path):
    cordon = str(tmp_path / "cordon.json")
    add_to_cordon(cordon, "node-7", "bad")
    out = _preflight("--cordon", cordon, "--host", "node-8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "not cordoned" in out.stdout


def test_require_gpu_on_a_cpu_host_refuses(tmp_path, recorded_nvml):
    import pynvml

    outcome = run_preflight(host="n", require_gpu=True,
                            nvml=recorded_nvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))
    assert outcome.exit_code == DO_NOT_RESTART_EXIT and "--require-gpu" in outcome.results[0].message


def test_a_failing_gpu_cordons_its_own_host(tmp_path, recorded_nvml):
    cordon = str(tmp_path / "cordon.json")
    outcome = run_preflight(cordon=cordon, host="node-3", add_to_cordon_on_fail=True,
                            nvml=recorded_nvml(HEALTHY, HEALTHY, xids=[(1, 79)]))
    assert outcome.exit_code == DO_NOT_RESTART_EXIT
    assert "XID 79" in is_cordoned(cordon, "node-3")


def test_smalti_launch_preflight_passes_the_code_through(tmp_path):
    cordon = str(tmp_path / "cordon.json")
    add_to_cordon(cordon, "node-9", "flaky switch port")
    out = subprocess.run([sys.executable, "-m", "smalti.core.launch.cli", "preflight", "--", "--cordon", cordon],
                         capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                          "SMALTI_NODE_NAME": "node-9"})
    assert out.returncode == 93, out.stdout + out.stderr
    assert "flaky switch port" in out.stdout
    healthy = subprocess.run([sys.executable, "-m", "smalti.core.launch.cli", "preflight", "--", "--cordon", cordon],
                             capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                              "SMALTI_NODE_NAME": "node-10"})
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
