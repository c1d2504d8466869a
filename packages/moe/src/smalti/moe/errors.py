"""smalti-moe's errors (subclasses of smalti-core's ``SmaltiError`` when core is installed)."""

try:
    from smalti.core.errors import SmaltiError as _Base
except ImportError:  # smalti-moe is usable without smalti-core
    _Base = Exception


class MoEError(_Base):
    """A bad MoE argument, an unavailable backend, or inconsistent expert-parallel setup."""
