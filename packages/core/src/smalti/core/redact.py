"""Credentials out of everything smalti prints, logs or saves: URL userinfo and the values of secret-named keys.

:func:`redact` is applied where a config leaves the process: the ``log_hyperparameters`` dispatch (every
logger: console, JSONL, MLflow, W&B), the run's saved ``.hydra`` files, and logger tags. The objects a run
builds keep the real values (a tracker still authenticates with the password in its URI).

A key names a secret when it contains, ignoring case, ``password``, ``passwd``, ``secret``, ``credential``,
``api_key``, ``access_key``, ``private_key`` (``-`` or nothing in place of ``_`` too) or ``token`` — except
``tokens`` and ``tokenizer``, which count or split text (``max_tokens``, ``data.tokenizer``) and are kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: What a secret is replaced with.
REDACTED = "***"

_SECRET_KEY = re.compile(r"password|passwd|secret|credential|api_?key|access_?key|private_?key|token(?!s|iz)",
                         re.IGNORECASE)
# scheme://userinfo@host: the userinfo (user, user:password or a bare token) up to the last '@' of the authority.
_URL_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.\-]*://)[^/?#\s@]+@")
# key=value inside a string (Hydra overrides, override_dirname, command lines) whose key names a secret.
_ASSIGNMENT = re.compile(r"([\w.+~/\-]+)=([^\s,]*)")


def is_secret_key(key: object) -> bool:
    """Whether a config or environment key names a secret (see the module docstring for the rule)."""
    return isinstance(key, str) and _SECRET_KEY.search(key.replace("-", "_")) is not None


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced: ``https://u:p@host`` -> ``https://***@host``."""
    return _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text)


def redact_text(text: str) -> str:
    """A string with URL userinfo and the values of ``secret_key=value`` assignments in it replaced."""
    text = redact_url(text)
    return _ASSIGNMENT.sub(lambda m: f"{m[1]}={REDACTED}" if is_secret_key(m[1]) and m[2] else m[0], text)


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
    return value
