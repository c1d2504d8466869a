"""``smalti-health gpu``: per-GPU health through NVML (nvidia-ml-py), every call under a deadline.

Read per device: ECC error counts (volatile and aggregate), remapped and pending rows, XID events since
the checker started, clock-event (throttle) reasons, and the driver's recovery action (r570+). The verdict
follows DCGM's XID classification (see ``XID_VERDICTS``). Fields a device does not support are skipped.
On a machine without NVML or without GPUs the single result says so (verdict ``ok``, metric
``health/gpu/count`` = 0). A call that does not return within its deadline is a ``fail`` naming the call
(NVML can block for ever on a failing GPU); the rest of that device's calls are then skipped, so a wedged
device costs one deadline, not one per call. ``nvmlInit`` itself hanging is a ``fail``, not "no GPU".
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

from smalti.health.deadline import DeadlineExceeded, call_with_deadline
from smalti.health.results import CheckResult, Verdict, worst

#: XID -> verdict, after DCGM's own mapping; an XID not listed is a warning.
XID_VERDICTS: dict[int, Verdict] = {
    48: Verdict.FAIL,  # double-bit ECC error
    63: Verdict.WARN,  # row remap / page retirement recorded: reset to activate
    64: Verdict.FAIL,  # row remap / page retirement failure
    74: Verdict.FAIL,  # NVLink critical error
    79: Verdict.FAIL,  # fallen off the bus
    92: Verdict.WARN,  # high single-bit ECC rate
    94: Verdict.WARN,  # contained ECC error
    95: Verdict.FAIL,  # uncontained ECC error
    119: Verdict.FAIL,  # GSP RPC timeout
    120: Verdict.FAIL,  # GSP error
    140: Verdict.FAIL,  # ECC unrecovered error
}

#: Clock-event reason bits that mean the GPU runs slower than it should (idle and app-clock bits are benign).
THROTTLE_BITS: dict[int, str] = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}

#: ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` and its values.
RECOVERY_ACTION_FIELD = 230
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}

_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_TIMEOUT = 10  # NVML_ERROR_TIMEOUT (an event wait with nothing to report)
_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
_DBE_EVENT = 0x2  # nvmlEventTypeDoubleBitEccError


def _nvml_code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class GpuChecker:
    """Holds an NVML session so XID events between checks are seen; ``check()`` reads every GPU once.

    ``nvml`` is the binding (``pynvml`` by default): tests pass an object replaying recorded answers.
    """

    def __init__(self, nvml: Any | None = None, call_deadline_s: float = 5.0) -> None:
        self.call_deadline_s = call_deadline_s
        self._nvml = nvml
        self._handles: list[Any] = []
        self._event_set: Any = None
        self.no_gpu_reason: str | None = None
        self.init_failure: str | None = None  # NVML is there but did not answer: a fail, not "no GPU"
        self._handle_errors: dict[int, str] = {}
        self._started = False

    # -------------------------------------------------------------- NVML calls

    def _call(self, name: str, *args: Any) -> Any:
        return call_with_deadline(getattr(self._nvml, name), *args, deadline_s=self.call_deadline_s, what=name)

    def start(self) -> bool:
        """Initialise NVML and register for XID events; False (with ``no_gpu_reason``) when there is no GPU."""
        if self._started:
            return self.no_gpu_reason is None and self.init_failure is None
        self._started = True
        if self._nvml is None:
            try:
                self._nvml = _load_pynvml()
            except ImportError as exc:  # nvidia-ml-py missing
                self.no_gpu_reason = f"nvidia-ml-py is not installed ({exc})"
                return False
        try:
            self._call("nvmlInit")
            count = int(self._call("nvmlDeviceGetCount"))
        except DeadlineExceeded as exc:
            self.init_failure = f"NVML did not answer: {exc} (a wedged driver or GPU)"
            return False
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.no_gpu_reason = f"no NVIDIA driver or library ({type(exc).__name__}: {exc})"
            return False
        if count == 0:
            self.no_gpu_reason = "NVML sees no GPU"
            return False
        self._handles = []
        for i in range(count):
            try:
                self._handles.append(self._call("nvmlDeviceGetHandleByIndex", i))
            except Exception as exc:  # GpuIsLost, a deadline...: this device fails, the others are still read
                self._handles.append(None)
                self._handle_errors[i] = f"nvmlDeviceGetHandleByIndex({i}) failed: {type(exc).__name__}: {exc}"
        try:
            self._event_set = self._call("nvmlEventSetCreate")
            for handle in self._handles:
                if handle is None:
                    continue
                self._call("nvmlDeviceRegisterEvents", handle, _XID_EVENT | _DBE_EVENT, self._event_set)
        except Exception:  # events unsupported (some VMs, MIG): the other signals still work
            self._event_set = None
        return True

    def close(self) -> None:
        """Free the event set and shut NVML down (never raises)."""
        if self._nvml is None or self.no_gpu_reason is not None or self.init_failure or not self._started:
            return
        for name, args in (("nvmlEventSetFree", (self._event_set,)), ("nvmlShutdown", ())):
            if name == "nvmlEventSetFree" and self._event_set is None:
                continue
            with contextlib.suppress(Exception):
                self._call(name, *args)
        self._started = False

    def _drain_xids(self) -> dict[int, list[int]]:
        """XIDs per device index seen since the last check (non-blocking)."""
        seen: dict[int, list[int]] = {}
        if self._event_set is None:
            return seen
        for _ in range(256):
            try:
                data = self._call("nvmlEventSetWait_v2", self._event_set, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: nothing pending
                break
            xid = int(getattr(data, "eventData", 0))
            index = self._device_index(getattr(data, "device", None))
            if int(getattr(data, "eventType", _XID_EVENT)) == _DBE_EVENT and not xid:
                xid = 48
            seen.setdefault(index, []).append(xid)
        return seen

    def _device_index(self, device: Any) -> int:
        """Which of our GPUs an event's ``device`` handle is (-1: unknown, then it counts against every GPU).

        pynvml handles are ctypes pointers: NVML gives the same address for a device each time, but every
        call wraps it in a new Python object and pointers compare by identity, so compare addresses.
        """
        if device is None:
            return -1
        key = _handle_address(device)
        index = next((i for i, h in enumerate(self._handles) if h is not None and _handle_address(h) == key), -1)
        if index < 0:
            with contextlib.suppress(Exception):
                index = int(self._call("nvmlDeviceGetIndex", device))
        return index if 0 <= index < len(self._handles) else -1

    # -------------------------------------------------------------- the check

    def check(self) -> list[CheckResult]:
        """One result per GPU (``gpu0``, ``gpu1``...), or one ``gpu`` result saying there is no GPU."""
        if not self.start():
            if self.init_failure:
                return [CheckResult("gpu", Verdict.FAIL, self.init_failure, {"health/gpu/verdict": 2.0})]
            return [CheckResult("gpu", Verdict.OK, f"no GPU: {self.no_gpu_reason}", {"health/gpu/count": 0.0})]
        xids = self._drain_xids()
        results = []
        for i, handle in enumerate(self._handles):
            if handle is None:
                results.append(CheckResult(f"gpu{i}", Verdict.FAIL, f"gpu{i}: {self._handle_errors[i]}",
                                           {f"health/gpu{i}/verdict": 2.0}))
            else:
                results.append(self._check_device(i, handle, xids.get(i, []) + xids.get(-1, [])))
        return results

    def _check_device(self, index: int, handle: Any, xids: list[int]) -> CheckResult:
        prefix = f"health/gpu{index}/"
        metrics: dict[str, float] = {}
        findings: list[tuple[Verdict, str]] = []
        wedged: list[str] = []  # the call that hung; later calls on this device are skipped

        def read(name: str, *args: Any) -> Any:
            if wedged:
                return None
            try:
                return self._call(name, handle, *args)
            except DeadlineExceeded as exc:
                wedged.append(name)
                findings.append((Verdict.FAIL, f"{exc} (a wedged driver or GPU; later calls skipped)"))
            except Exception as exc:
                if _nvml_code(exc) != _NOT_SUPPORTED and "NotSupported" not in type(exc).__name__:
                    findings.append((Verdict.WARN, f"{name} failed: {type(exc).__name__}: {exc}"))
            return None

        name = read("nvmlDeviceGetName")
        n = self._nvml
        unc = getattr(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        cor = getattr(n, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        volatile, aggregate = getattr(n, "NVML_VOLATILE_ECC", 0), getattr(n, "NVML_AGGREGATE_ECC", 1)
        ecc = {
            "ecc_volatile_uncorrected": read("nvmlDeviceGetTotalEccErrors", unc, volatile),
            "ecc_volatile_corrected": read("nvmlDeviceGetTotalEccErrors", cor, volatile),
            "ecc_aggregate_uncorrected": read("nvmlDeviceGetTotalEccErrors", unc, aggregate),
        }
        for key, value in ecc.items():
            if value is not None:
                metrics[prefix + key] = float(value)
        if ecc["ecc_volatile_uncorrected"]:
            findings.append((Verdict.FAIL, f"{ecc['ecc_volatile_uncorrected']} uncorrected ECC errors since boot"))
        elif ecc["ecc_aggregate_uncorrected"]:
            findings.append((Verdict.WARN, f"{ecc['ecc_aggregate_uncorrected']} uncorrected ECC errors in its life"))

        rows = read("nvmlDeviceGetRemappedRows")
        if rows is not None:
            corr, unc_rows, pending, failure = (int(v) for v in rows)
            metrics.update({prefix + "remapped_rows_correctable": float(corr),
                            prefix + "remapped_rows_uncorrectable": float(unc_rows),
                            prefix + "remapped_rows_pending": float(pending),
                            prefix + "remapped_rows_failure": float(failure)})
            if failure:
                findings.append((Verdict.FAIL, "row remapping failed: the GPU has run out of spare rows"))
            elif pending:
                findings.append((Verdict.WARN, "a row remap is pending: reset the GPU to apply it"))

        reasons = read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is not None:
            metrics[prefix + "clock_event_reasons"] = float(reasons)
            active = [label for bit, label in THROTTLE_BITS.items() if int(reasons) & bit]
            if active:
                findings.append((Verdict.WARN, "throttled: " + ", ".join(active)))

        temperature = read("nvmlDeviceGetTemperature", getattr(n, "NVML_TEMPERATURE_GPU", 0))
        if temperature is not None:
            metrics[prefix + "temperature_c"] = float(temperature)

        fields = read("nvmlDeviceGetFieldValues", [RECOVERY_ACTION_FIELD])
        if fields:
            field = fields[0]
            if int(getattr(field, "nvmlReturn", 0)) == 0:
                action = int(field.value.ullVal)
                metrics[prefix + "recovery_action"] = float(action)
                label = RECOVERY_ACTIONS.get(action, f"unknown({action})")
                if action == 3:
                    findings.append((Verdict.WARN, f"driver recovery action: {label}"))
                elif action:
                    findings.append((Verdict.FAIL, f"driver recovery action: {label}"))

        for xid in xids:
            verdict = XID_VERDICTS.get(xid, Verdict.WARN)
            findings.append((verdict, f"XID {xid}"))
        if xids:
            metrics[prefix + "xid_last"] = float(xids[-1])
        verdict = worst(*(v for v, _ in findings))
        metrics[prefix + "verdict"] = float({Verdict.OK: 0, Verdict.WARN: 1, Verdict.FAIL: 2}[verdict])
        label = f"gpu{index}" + (f" ({_text(name)})" if name else "")
        message = "; ".join(m for _, m in findings) or "healthy"
        return CheckResult(f"gpu{index}", verdict, f"{label}: {message}", metrics)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_gpus(nvml: Any | None = None, call_deadline_s: float = 5.0) -> list[CheckResult]:
    """Check every GPU once (see :class:`GpuChecker`); NVML is shut down afterwards."""
    checker = GpuChecker(nvml, call_deadline_s)
    try:
        return checker.check()
    finally:
        checker.close()


def _handle_address(handle: Any) -> Any:
    """The address a pynvml device handle points at (the handle itself when it is no pointer)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle
