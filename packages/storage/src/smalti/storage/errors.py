"""smalti-storage's exceptions: one base, :class:`StorageError`, and one subclass per failure a user can fix.

smalti-storage depends on no sibling package, so :class:`StorageError` does not derive from
``smalti.core.errors.SmaltiError`` (importing core would also import torch). Code that has core treats both
alike with ``except (SmaltiError, StorageError)``: core's CLI error handler is the one place that needs it.
(A virtual subclass through ``ABCMeta.register`` would not do: ``except`` clauses ignore virtual
subclasses.) Packages that wrap a storage failure in their own error keep it as ``__cause__``.
"""

from __future__ import annotations

import re

# scheme://userinfo@host, up to the last '@' of the authority (a password may hold '@').
# oci:// is left out: its ``bucket@namespace`` authority names a bucket, not a user.
_URL_USERINFO = re.compile(r"\b((?!oci://)[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/?#\s]*@")
# Query parameters that carry credentials: presigned S3 URLs, Azure SAS tokens, GCS signed URLs, tokens, keys.
_SECRET_QUERY = re.compile(
    r"([?&;](?:[\w.\-]*(?:signature|credential|token|password|passwd|secret|key|sig|auth)[\w.\-]*))=([^&#\s'\"]*)",
    re.IGNORECASE,
)


def scrub_credentials(text: str) -> str:
    """``text`` with the userinfo of every URL and every credential-bearing query parameter replaced by ``***``.

    smalti-storage's errors name the URL at fault; this keeps the credentials a URL may carry out of them.
    (smalti-core's :mod:`smalti.core.redact` applies the same rule to everything a run prints.)
    """
    text = _URL_USERINFO.sub(r"\g<1>***@", text)
    return _SECRET_QUERY.sub(r"\g<1>=***", text)


class StorageError(Exception):
    """Base of every error smalti-storage raises; the message names the URL at fault and the fix.

    ``url`` is the object or store concerned (when there is one); ``cause`` is the client library's exception
    when the message replaced it (kept off the printed traceback, which would only repeat it at length). The
    message and ``url`` never hold credentials: URL userinfo and credential query parameters are replaced.
    """

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(scrub_credentials(message))
        self.url = scrub_credentials(url) if url is not None else None
        self.cause: BaseException | None = None


class UnknownSchemeError(StorageError, ValueError):
    """A URL whose scheme no built-in backend and no ``smalti.storage`` entry point handles."""


class MissingClientError(StorageError, ImportError):
    """The cloud client library a scheme needs is not installed; the message gives the pip extra."""


class CredentialsError(StorageError):
    """No credentials were found; the message says where the cloud's chain looked."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket (or Azure container) named in the URL does not exist."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist (its bucket does)."""


class ObjectTooLargeError(StorageError):
    """The object holds more bytes than the caller was told to expect (an index or manifest declares each
    file's size): it is refused before, or as soon as, the excess would be written, and nothing is kept."""


class PermissionDeniedError(StorageError, PermissionError):
    """The credentials were found but are not allowed to do this."""


class RetryBudgetExceededError(StorageError):
    """Transient failures (throttling, 5xx, connection errors) went on past the retry budget.

    ``attempts`` and ``elapsed_s`` say how long it tried; ``__cause__`` is the last failure.
    """

    def __init__(self, message: str, url: str | None = None, attempts: int = 0, elapsed_s: float = 0.0) -> None:
        super().__init__(message, url)
        self.attempts = attempts
        self.elapsed_s = elapsed_s


class IntegrityError(StorageError):
    """What was stored or fetched does not match what was expected (size after upload, a caller's check)."""


class UnsafeLocalPathError(StorageError):
    """A local path that is not what it claims: a symbolic link where a plain file or folder must be, or a
    cache folder another user owns or may write into. ``url`` is the path at fault."""
