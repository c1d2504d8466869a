"""smalti-health's errors (subclasses of smalti-core's ``SmaltiError``)."""

from smalti.core.errors import SmaltiError


class HealthError(SmaltiError):
    """A health check could not run or was given bad arguments; the message names the value at fault."""
