"""The one exception hierarchy of smalti: every package's errors subclass :class:`SmaltiError`."""


class SmaltiError(Exception):
    """Base class of every error smalti raises on purpose. Messages say what is wrong and how to fix it."""


class ConfigError(SmaltiError, ValueError):
    """A config value or key is wrong: the message names the key, the value and the valid choices."""


class PluginError(SmaltiError):
    """A plugin failed to load or implements a hook that does not exist."""


class TimeError(ConfigError):
    """A time string such as ``"2ep"`` could not be parsed or converted."""


class TrainingError(SmaltiError, RuntimeError):
    """Training cannot go on: a model without ``loss``, an empty dataloader, a NaN loss, ..."""


class DistributedError(SmaltiError, RuntimeError):
    """Ranks disagree (config hash, batch counts) or the process group cannot start."""


class BuildError(SmaltiError, RuntimeError):
    """Building the run's data, model or trainer failed: the message names the part and the cause.

    ``smalti-train`` prints it as one line (``HYDRA_FULL_ERROR=1`` for the traceback of the cause).
    """


class UnsupportedVersionError(SmaltiError, ImportError):
    """An installed dependency (torch, pluggy, OmegaConf, Hydra) lacks a private name smalti relies on.

    Raised when a package's ``_compat`` module is imported, so a mismatched install fails at import rather than
    mid-run; the message names the dependency, its version, the missing name and the versions smalti is tested with.
    """
