"""Shared test helpers for smalti's packages: ports, torchrun, loopback servers, event recording.

Loaded as a pytest plugin through the ``pytest11`` entry point, so every package's tests get the fixtures
and the ``world_size`` marker without importing each other's conftest files.
"""

from smalti.testing.metrics import MetricsRecorder
from smalti.testing.ports import free_port
from smalti.testing.torchrun import run_torchrun

__version__ = "0.1.0"

__all__ = ["MetricsRecorder", "free_port", "run_torchrun"]
