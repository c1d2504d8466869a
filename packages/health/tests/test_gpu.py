"""NVML checks against recorded NVML answers: verdicts by the XID table, throttling, deadlines, no GPU."""

import subprocess
import sys
import time

import pynvml
import pytest

from smalti.health.gpu import GpuChecker, check_gpus
from smalti.health.results import Verdict

HEALTHY = {"name": "NVIDIA H100 80GB HBM3", "recovery": 0}


def test_a_healthy_gpu_is_ok_with_its_metrics(recorded_nvml):
    (result,) = check_gpus(recorded_nvml(HEALTHY))
    assert result.verdict is Verdict.OK and result.name == "gpu0"
    assert "H100" in result.message and "healthy" in result.message
    assert result.metrics["health/gpu0/ecc_volatile_uncorrected"] == 0
    assert result.metrics["health/gpu0/temperature_c"] == 45
    assert result.metrics["health/gpu0/verdict"] == 0


@pytest.mark.parametrize("xid, verdict", [(79, Verdict.FAIL), (48, Verdict.FAIL), (64, Verdict.FAIL),
                                          (95, Verdict.FAIL), (63, Verdict.WARN), (94, Verdict.WARN),
                                          (13, Verdict.WARN)])
def test_xid_events_follow_the_reference_table(recorded_nvml, xid, verdict):
    results = check_gpus(recorded_nvml(HEALTHY, HEALTHY, xids=[(1, xid)]))
    assert [r.verdict for r in results] == [Verdict.OK, verdict]
    assert f"XID {xid}" in results[1].message and results[1].metrics["health/gpu1/xid_last"] == xid


def test_ecc_rows_throttling_and_recovery_action(recorded_nvml):
    results = check_gpus(recorded_nvml(
        {**HEALTHY, "ecc": {(1, 0): 2}},  # volatile uncorrected
        {**HEALTHY, "ecc": {(1, 1): 1}},  # only in the lifetime count
        {**HEALTHY, "remapped": (3, 1, 1, 0)},  # a remap pending
        {**HEALTHY, "remapped": (0, 0, 0, 1)},  # remapping failed
        {**HEALTHY, "reasons": 0x40 | 0x4},  # hw thermal + sw power cap
        {**HEALTHY, "recovery": 2},  # node reboot
    ))
    verdicts = [r.verdict for r in results]
    assert verdicts == [Verdict.FAIL, Verdict.WARN, Verdict.WARN, Verdict.FAIL, Verdict.WARN, Verdict.FAIL]
    assert "2 uncorrected ECC errors since boot" in results[0].message
    assert "reset the GPU" in results[2].message
    assert "hw_thermal" in results[4].message and "sw_power_cap" in results[4].message
    assert "node_reboot" in results[5].message


def test_unsupported_calls_are_skipped_not_failures(recorded_nvml):
    (result,) = check_gpus(recorded_nvml({**HEALTHY, "recovery": None,
                                          "unsupported": {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetTemperature"}}))
    assert result.verdict is Verdict.OK
    assert "health/gpu0/remapped_rows_pending" not in result.metrics and "health/gpu0/recovery_action" not in result.metrics


def test_a_call_that_never_returns_is_reported_within_its_deadline(recorded_nvml):
    fake = recorded_nvml({**HEALTHY, "block": "nvmlDeviceGetRemappedRows"})
    start = time.monotonic()
    (result,) = check_gpus(fake, call_deadline_s=0.5)
    assert time.monotonic() - start < 3
    assert result.verdict is Verdict.FAIL and "nvmlDeviceGetRemappedRows did not return within 0.5 s" in result.message


def test_a_wedged_device_costs_one_deadline_and_the_others_are_still_read(recorded_nvml):
    every_call = {"nvmlDeviceGetName", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                  "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperature", "nvmlDeviceGetFieldValues"}
    start = time.monotonic()
    wedged, healthy = check_gpus(recorded_nvml({**HEALTHY, "block": every_call}, HEALTHY), call_deadline_s=0.4)
    assert time.monotonic() - start < 0.4 + 1.5  # one deadline, not one per call
    assert wedged.verdict is Verdict.FAIL and "nvmlDeviceGetName did not return within 0.4 s" in wedged.message
    assert healthy.verdict is Verdict.OK


def test_nvml_init_that_hangs_is_a_failure_not_no_gpu(recorded_nvml):
    start = time.monotonic()
    (result,) = check_gpus(recorded_nvml(HEALTHY, init_block=True), call_deadline_s=0.3)
    assert time.monotonic() - start < 2
    assert result.verdict is Verdict.FAIL and "nvmlInit did not return within 0.3 s" in result.message


def test_a_gpu_fallen_off_the_bus_fails_alone(recorded_nvml):
    lost, ok = check_gpus(recorded_nvml({**HEALTHY, "lost": True}, HEALTHY))
    assert lost.verdict is Verdict.FAIL and "nvmlDeviceGetHandleByIndex(0)" in lost.message
    assert ok.verdict is Verdict.OK


def test_xids_between_checks_are_seen_once(recorded_nvml):
    fake = recorded_nvml(HEALTHY)
    checker = GpuChecker(fake)
    assert checker.check()[0].verdict is Verdict.OK
    fake.xids.append((0, 79))
    assert checker.check()[0].verdict is Verdict.FAIL
    assert checker.check()[0].verdict is Verdict.OK
    checker.close()
    assert fake.calls[-1] == "nvmlShutdown"


def test_no_driver_is_a_plain_no_gpu_result(recorded_nvml):
    (result,) = check_gpus(recorded_nvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))
    assert result.verdict is Verdict.OK and result.message.startswith("no GPU")


def test_cli_on_a_machine_without_gpu_exits_4_without_traceback():
    out = subprocess.run([sys.executable, "-m", "smalti.health.cli", "gpu"], capture_output=True, text=True, timeout=60)
    if "no GPU" not in out.stdout:
        pytest.skip("this machine has a GPU")
    assert out.returncode == 4
    assert "Traceback" not in out.stderr
