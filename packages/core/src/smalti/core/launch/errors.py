"""Errors of the scale-out tools."""

from smalti.core.errors import SmaltiError


class LaunchError(SmaltiError):
    """A launch cannot be prepared: a bad cordon file, missing run logs, inconsistent node or process counts."""
