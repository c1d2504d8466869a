"""smalti-core: the trainer, its state and time units, and the plugin system every smalti package builds on."""

__version__ = "0.1.0"

from smalti.core.errors import ConfigError, PluginError, SmaltiError, TrainingError  # noqa: E402
from smalti.core.evaluator import Evaluator  # noqa: E402
from smalti.core.plugins import Algorithm, Callback, LoggerDestination, hookimpl  # noqa: E402
from smalti.core.state import State  # noqa: E402
from smalti.core.time import Time, Timestamp, TimeUnit  # noqa: E402
from smalti.core.trainer import Trainer  # noqa: E402

__all__ = [
    "Algorithm",
    "Callback",
    "ConfigError",
    "Evaluator",
    "LoggerDestination",
    "PluginError",
    "SmaltiError",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trainer",
    "TrainingError",
    "hookimpl",
]
