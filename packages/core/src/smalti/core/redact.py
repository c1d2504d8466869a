"""Credentials out of everything smalti prints, logs or saves: URL userinfo and the values of secret-named keys.

:func:`redact` is applied where a config leaves the process: the ``log_hyperparameters`` dispatch (every
logger: console, JSONL, MLflow, W&B), the run's saved ``.hydra`` files, and logger tags; and
:func:`install_log_redaction` passes every log record of the process (smalti's and Hydra's: the sweep launcher's
list of overrides, "Error executing job with overrides") through :func:`redact_text`. The objects a run
builds keep the real values (a tracker still authenticates with the password in its URI).

A key names a secret when, ignoring case and with ``-`` read as ``_``, it contains ``password``, ``passwd``,
``passphrase``, ``secret``, ``credential``, ``api_key``, ``access_key``, ``private_key``, ``authorization``,
``cookie``, ``bearer``, ``signature``, ``connection_string``, ``webhook_url`` or ``token`` (except ``tokens`` and
``tokenizer``, which count or split text); when one of its words (split at ``_``, ``.``, digits and case changes)
is ``auth``, ``pwd``, ``pass``, ``session``, ``sas``, ``sig`` or ``dsn``; or when it ends in ``_key`` (except the data
column names ``prompt_key``, ``response_key``, ``text_key``, ``messages_key`` and OmegaConf's ``full_key``).

Besides the patterns, the values found under secret keys of a run's config are remembered
(:func:`remember_secrets`), and any later text that holds one of them has it replaced too: a config error
that quotes the bad value, an exception message, a command line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import IO, Any

#: What a secret is replaced with.
REDACTED = "***"

_SECRET_PART = re.compile(
    r"password|passwd|passphrase|secret|credential|api_?key|access_?key|private_?key|authorization|cookie|bearer"
    r"|signature|connection_?string|webhook_?url|token(?!s|iz)",
    re.IGNORECASE,
)
_SECRET_WORDS = frozenset({"auth", "pwd", "pass", "session", "sas", "sig", "dsn"})
#: ``*_key`` names that are data column names, not secrets.
_NOT_SECRET_KEYS = frozenset({"prompt_key", "response_key", "text_key", "messages_key", "full_key"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# scheme://userinfo@host: the userinfo (user, user:password or a bare token) up to the LAST '@' of the
# authority, so a password holding '@' is taken whole.
# oci:// is left out: its ``bucket@namespace`` authority names a bucket, not a user.
_URL_USERINFO = re.compile(r"\b((?!oci://)[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/?#\s]*@")
# key=value inside a string (Hydra overrides, override_dirname, command lines, URL queries) whose key names a
# secret; a quoted value is taken to its closing quote (Hydra's '+x.db_password='a b''), an unquoted one stops at
# whitespace, ',', '&' and ';' (the separators of overrides and queries).
_ASSIGNMENT = re.compile(r"""([\w.+~/\-]+)( ?= ?)(?:(["'])(.*?)\3|([^\s,&;'"]*))""")
# "key": "value" and key: value (JSON, YAML and Python reprs in messages); quoted values to their closing quote.
_COLON_ASSIGNMENT = re.compile(r"""(["']?)([\w.\-]+)\1(\s*:\s*)(?:(["'])(.*?)\4|([^\s,"'}\]]+))""")
# An HTTP credential: an Authorization header's whole value (any scheme), and a token after "Bearer" anywhere
# (8 characters or more, so that prose such as "bearer of" is left alone).
_AUTH_HEADER = re.compile(r"""((?:proxy-)?authorization["']?\s*[:=]\s*["']?)([^"'\r\n,}]+)""", re.IGNORECASE)
_AUTH_SCHEME = re.compile(r"\b(bearer)(\s+)([A-Za-z0-9._~+/\-]{8,}=*)", re.IGNORECASE)
# A command-line flag naming a secret followed by its value as the next word: ``--password hunter2``.
_FLAG_VALUE = re.compile(r"""(?<![\w-])(--?[A-Za-z][\w.\-]*)(\s+)(?:(["'])(.*?)\3|([^\s"'-][^\s]*))""")
# A plain number after a secret-looking key is a count (``Timestamp(token=512)``), not a secret; a number given
# as a secret in the config is still remembered and replaced (:func:`remember_secrets`).
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?[)\]}]*$")
#: Remembered secret values shorter than this are not searched for (too likely to match by chance).
MIN_REMEMBERED = 4

_remembered: set[str] = set()
_remembered_lock = threading.Lock()


def is_secret_key(key: object) -> bool:
    """Whether a config or environment key names a secret (see the module docstring for the rule)."""
    if not isinstance(key, str):
        return False
    name = key.replace("-", "_")
    last = name.rsplit(".", 1)[-1].lower().lstrip("_+~")
    if _SECRET_PART.search(name):
        return True
    if last.endswith("_key") and last not in _NOT_SECRET_KEYS:
        return True
    return any(word.lower() in _SECRET_WORDS for word in _WORD.findall(name))


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced: ``https://u:p@host`` -> ``https://***@host``."""
    return _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text)


def redact_text(text: str) -> str:
    """A string with URL userinfo, HTTP credentials (``Authorization:`` values, ``Bearer <token>``), the values of
    ``secret_key=value``, ``secret_key: value`` and ``--secret-flag value``, and every remembered secret value
    (:func:`remember_secrets`) in it replaced; a quoted value keeps its quotes."""
    text = redact_url(text)
    text = _AUTH_HEADER.sub(rf"\g<1>{REDACTED}", text)
    text = _AUTH_SCHEME.sub(rf"\g<1>\g<2>{REDACTED}", text)
    text = _replace_values(_ASSIGNMENT, text, key=1, separator=2)
    text = _replace_values(_COLON_ASSIGNMENT, text, key=2, separator=3)
    text = _replace_values(_FLAG_VALUE, text, key=1, separator=2)
    with _remembered_lock:
        remembered = sorted(_remembered, key=len, reverse=True)
    for secret in remembered:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _replace_values(pattern: re.Pattern[str], text: str, key: int, separator: int) -> str:
    """``text`` with the value of every ``pattern`` match whose ``key`` group names a secret replaced.

    ``pattern``'s last three groups are the value's quote, the quoted value and the bare value. After a key that
    names no secret the scan goes on just past the separator, so a secret inside that value (a query in a quoted
    URL, a quoted dict: ``'{'api_key': 'v'}'``) is still found.
    """
    out: list[str] = []
    pos = 0
    while (m := pattern.search(text, pos)) is not None:
        quote, quoted, bare = m.groups()[-3:]
        value = quoted if quote else bare
        if not is_secret_key(m[key].lstrip("-")) or not value or value == REDACTED \
                or (not quote and _NUMBER.match(value)):
            out.append(text[pos:m.end(separator)])
            pos = max(m.end(separator), m.start() + 1)
            continue
        out.append(f"{text[pos:m.end(separator)]}{quote}{REDACTED}{quote}" if quote
                   else f"{text[pos:m.end(separator)]}{REDACTED}")
        pos = m.end()
    return "".join(out) + text[pos:]


def redact_bytes(data: bytes) -> bytes:
    """:func:`redact_text` for bytes (any encoding that is ASCII-compatible; other bytes are kept as they are)."""
    return redact_text(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


def remember_secrets(value: Any) -> None:
    """Remember the values under secret keys and the URL userinfo in ``value`` (a config, a list of overrides),
    so that :func:`redact_text` replaces them wherever they turn up later, whatever the text around them."""
    found: set[str] = set()
    for key, item in _walk(value):
        if isinstance(item, str | int | float) and not isinstance(item, bool) and key is not None \
                and is_secret_key(key):
            found.add(str(item))
        if isinstance(item, str):
            found.update(m.group(0)[len(m.group(1)):-1] for m in _URL_USERINFO.finditer(item))
            found.update(v for m in _ASSIGNMENT.finditer(item) if (v := m[4] if m[3] else m[5]) and is_secret_key(m[1]))
    found = {f for f in found if len(f) >= MIN_REMEMBERED and f != REDACTED}
    for f in list(found):  # user:password userinfo: the password alone too
        if ":" in f:
            found.add(f.split(":", 1)[1])
    with _remembered_lock:
        _remembered.update(f for f in found if len(f) >= MIN_REMEMBERED)


def _walk(value: Any, key: str | None = None) -> Iterable[tuple[str | None, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, str(k))
    elif isinstance(value, list | tuple | set):
        for v in value:
            yield from _walk(v, key)
    else:
        yield key, value


_record_factory_installed = False


def install_log_redaction() -> None:
    """Pass every log record this process creates through :func:`redact_text` (idempotent).

    A record factory rather than a handler filter: Hydra configures its own handlers when a job starts, and a
    factory sees the records of every logger (smalti's, Hydra's launchers and sweepers, libraries') before any
    handler formats them.
    """
    global _record_factory_installed
    if _record_factory_installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: leave it to logging to report
            return record
        clean = redact_text(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
    _record_factory_installed = True


class RedactedStream(io.TextIOBase):
    """A text stream that passes each write to ``stream`` through :func:`redact_text`.

    For whole blocks printed at once, such as Hydra's ``--cfg job`` (which prints the config with ``print``, not
    through logging); a secret split across two writes would pass.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


def redact_exception(exc: BaseException) -> BaseException:
    """Redact the string arguments of ``exc`` and of every exception it was raised from, in place (so that a
    printed traceback shows no secret); returns ``exc``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        with contextlib.suppress(Exception):  # an exception type whose args cannot be set: leave it
            current.args = tuple(redact_text(a) if isinstance(a, str) else a for a in current.args)
        current = current.__cause__ or current.__context__
    return exc


def redact(value: Any) -> Any:
    """A copy of ``value`` (mappings, lists and tuples nested in any way) safe to print, log or save.

    The value of a key naming a secret becomes :data:`REDACTED` (``None`` stays ``None``, so "unset" still
    shows); every string has URL userinfo and ``secret_key=value`` assignments replaced.
    """
    if isinstance(value, Mapping):
        return {k: (REDACTED if value[k] is not None else None) if is_secret_key(k) else redact(value[k])
                for k in value}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, bytes):
        return redact_bytes(value)
    return value
