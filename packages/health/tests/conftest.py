"""A fake NVML binding that replays recorded answers (no GPU on CI), shared by the GPU tests."""

import ctypes
import threading
from types import SimpleNamespace

import pynvml
import pytest


class RecordedNvml:
    """Stands in for ``pynvml`` at the binding boundary, answering from a recorded per-device dict.

    ``devices`` is a list of dicts: ``name``, ``ecc`` {(type, counter): n}, ``remapped`` tuple, ``reasons``,
    ``temperature``, ``recovery`` (None: field unsupported), ``unsupported`` (set of call names),
    ``block`` (call name, or set of names, that never return), ``lost`` (True: its handle raises GpuIsLost).
    ``xids`` is a list of (device index, xid) pending events; ``init_block`` makes ``nvmlInit`` hang.
    Handles are what real pynvml gives: ctypes device pointers, a new object on every call with the same
    address for the same device (so ``==`` between two handles of one device is False, as on real NVML).
    """

    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices, xids=(), init_error=None, init_block=False):
        self.devices = devices
        self.xids = list(xids)
        self.init_error = init_error
        self.init_block = init_block
        self.calls = []
        self.released = threading.Event()

    @staticmethod
    def _handle(index):
        return ctypes.cast(ctypes.c_void_p(0x1000 * (index + 1)), pynvml.c_nvmlDevice_t)

    @staticmethod
    def _index(handle):
        return ctypes.cast(handle, ctypes.c_void_p).value // 0x1000 - 1

    def _dev(self, handle, call):
        self.calls.append(call)
        dev = self.devices[self._index(handle)]
        if call in dev.get("unsupported", ()):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        block = dev.get("block", ())
        if call == block or (isinstance(block, set | frozenset) and call in block):
            self.released.wait(30)
        return dev

    def nvmlInit(self):
        if self.init_block:
            self.released.wait(30)
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.devices[i].get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._handle(i)

    def nvmlDeviceGetIndex(self, h):
        return self._index(h)

    def nvmlDeviceGetName(self, h):
        return self._dev(h, "nvmlDeviceGetName").get("name", "NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self._dev(h, "nvmlDeviceGetTotalEccErrors").get("ecc", {}).get((kind, counter), 0)

    def nvmlDeviceGetRemappedRows(self, h):
        return self._dev(h, "nvmlDeviceGetRemappedRows").get("remapped", (0, 0, 0, 0))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._dev(h, "nvmlDeviceGetCurrentClocksEventReasons").get("reasons", 0x1)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._dev(h, "nvmlDeviceGetTemperature").get("temperature", 45)

    def nvmlDeviceGetFieldValues(self, h, fields):
        action = self._dev(h, "nvmlDeviceGetFieldValues").get("recovery")
        if action is None:
            return [SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, value=None)]
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=action))]

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, mask, event_set):
        pass

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        index, xid = self.xids.pop(0)
        return SimpleNamespace(device=self._handle(index), eventType=0x8, eventData=xid)

    def nvmlEventSetFree(self, event_set):
        pass


@pytest.fixture
def recorded_nvml():
    """Build a :class:`RecordedNvml` from recorded device answers."""
    fakes = []

    def make(*devices, xids=(), init_error=None, init_block=False):
        fake = RecordedNvml(list(devices), xids, init_error, init_block)
        fakes.append(fake)
        return fake

    yield make
    for fake in fakes:
        fake.released.set()
