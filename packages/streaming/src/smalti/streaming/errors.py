"""smalti-streaming's errors (subclasses of smalti-core's ``SmaltiError`` when core is installed)."""

try:
    from smalti.core.errors import SmaltiError as _Base
except ImportError:  # smalti-streaming is usable without smalti-core
    _Base = Exception


class StreamingError(_Base):
    """Bad dataset arguments or an index/shard that cannot be used; the message names the file or key."""


class ShardCorruptError(StreamingError):
    """A shard's bytes do not match its index (hash mismatch, truncation); names the shard and the stream."""


class DownloadError(StreamingError):
    """A remote file could not be fetched after every retry."""


class UnsafePathError(StreamingError):
    """A file or folder name read from a file (an index's shard basename, a sub-index) would leave its folder."""


class UploadError(StreamingError):
    """A dataset file could not be written to its remote store (after smalti-storage's retries)."""
