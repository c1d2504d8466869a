"""Packages that import their public names on first use (PEP 562), so that importing them stays cheap.

Plugin discovery imports every smalti package's entry point in every process; a package ``__init__`` that
imported its trainer, FSDP or transformers modules up front would make that seconds long.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names are ``exports`` (name -> module).

    A name is imported from its module on first access and kept in ``namespace`` (the package's ``globals()``),
    so later accesses are plain attribute reads. Use as
    ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())``.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
