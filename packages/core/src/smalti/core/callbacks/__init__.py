"""Callbacks: speed/MFU, learning rate and memory monitors, NaN guard, early stopping, progress bar."""

from smalti.core.callbacks.activation_monitor import ActivationMonitor
from smalti.core.callbacks.early_stopping import EarlyStopping
from smalti.core.callbacks.goodput import Goodput
from smalti.core.callbacks.loss_spike import LossSpike
from smalti.core.callbacks.lr_monitor import LRMonitor
from smalti.core.callbacks.memory_monitor import MemoryMonitor
from smalti.core.callbacks.nan_guard import NaNGuard
from smalti.core.callbacks.optimizer_monitor import OptimizerMonitor
from smalti.core.callbacks.profiler import Profiler
from smalti.core.callbacks.progress_bar import ProgressBar
from smalti.core.callbacks.runtime_estimator import RuntimeEstimator
from smalti.core.callbacks.speed_monitor import PEAK_FLOPS, SpeedMonitor, peak_flops

__all__ = [
    "PEAK_FLOPS",
    "ActivationMonitor",
    "EarlyStopping",
    "Goodput",
    "LRMonitor",
    "LossSpike",
    "MemoryMonitor",
    "NaNGuard",
    "OptimizerMonitor",
    "Profiler",
    "ProgressBar",
    "RuntimeEstimator",
    "SpeedMonitor",
    "peak_flops",
]
