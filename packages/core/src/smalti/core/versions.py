"""Resolving a dependency's private names once, at import time, with a clear error when a version lacks one.

Each smalti package keeps the private names of torch, pluggy, OmegaConf and Hydra it uses in its own
``_compat`` module, built with :func:`private_name`. Importing that module is the check: an upgrade that moves
or drops a name fails there, naming the dependency, its installed version and the tested range, instead of in
the middle of a run. ``_compat`` modules list what they resolved in ``PRIVATE_NAMES`` so a test can check each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Any

from smalti.core.errors import UnsupportedVersionError

#: The dependency versions smalti's CI runs with (what the ``_compat`` modules are known to work with).
TESTED = {"torch": "2.13", "pluggy": "1.5 - 1.7", "omegaconf": "2.3", "hydra-core": "1.3"}


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``"not installed"`` when it is absent)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def unsupported(distribution: str, name: str, why: str = "") -> UnsupportedVersionError:
    """The error for a private ``name`` of ``distribution`` that the installed version does not have."""
    tested = TESTED.get(distribution, "the versions in the package's pyproject.toml")
    detail = f" ({why})" if why else ""
    return UnsupportedVersionError(
        f"{distribution} {installed_version(distribution)} has no {name}{detail}; smalti is tested with "
        f"{distribution} {tested}: install a version in the range the smalti package's pyproject.toml declares")


def private_name(module: str, attr: str | None = None, *, distribution: str = "torch",
                 fallback: Callable[..., Any] | None = None) -> Any:
    """``module.attr`` (or the module itself when ``attr`` is ``None``), imported now.

    When the installed ``distribution`` lacks it, returns ``fallback`` if one is given (a public or local
    equivalent), else raises :class:`~smalti.core.errors.UnsupportedVersionError` naming the version.
    """
    where = f"{module}.{attr}" if attr else module
    try:
        found = importlib.import_module(module)
        return getattr(found, attr) if attr else found
    except (ImportError, AttributeError) as exc:
        if fallback is not None:
            return fallback
        raise unsupported(distribution, where, str(exc)) from exc
