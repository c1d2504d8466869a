"""smalti-core: the trainer, its state and time units, and the plugin system every smalti package builds on.

The names below are imported on first use, so that ``import smalti.core.errors`` (which every plugin's
error classes derive from) does not pull in torch: plugin entry points stay cheap to discover.
"""

from smalti.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Algorithm": "smalti.core.plugins",
    "Callback": "smalti.core.plugins",
    "ConfigError": "smalti.core.errors",
    "Evaluator": "smalti.core.evaluator",
    "FitResult": "smalti.core.trainer",
    "LoggerDestination": "smalti.core.plugins",
    "PluginError": "smalti.core.errors",
    "SmaltiError": "smalti.core.errors",
    "State": "smalti.core.state",
    "Time": "smalti.core.time",
    "TimeUnit": "smalti.core.time",
    "Timestamp": "smalti.core.time",
    "Trainer": "smalti.core.trainer",
    "TrainingError": "smalti.core.errors",
    "hookimpl": "smalti.core.plugins",
    "seed_all": "smalti.core.seed",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
