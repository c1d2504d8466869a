"""smalti's plugin system: pluggy markers, the hookspecs, the plugin manager and the plugin base classes.

Hook implementations are marked with :data:`hookimpl` (or are spec-named methods of a :class:`Callback`,
:class:`Algorithm` or :class:`LoggerDestination` subclass). A package that must not import smalti-core may
make the same marker itself with ``pluggy.HookimplMarker("smalti")``.
"""

import pluggy

PROJECT_NAME = "smalti"
ENTRY_POINT_GROUP = "smalti"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

from smalti.core.plugins.base import Algorithm, Callback, LoggerDestination, SmaltiPlugin  # noqa: E402
from smalti.core.plugins.manager import (  # noqa: E402
    SmaltiPluginManager,
    get_plugin_manager,
    new_plugin_manager,
    reset_plugin_manager,
)

__all__ = [
    "Algorithm",
    "Callback",
    "LoggerDestination",
    "SmaltiPlugin",
    "SmaltiPluginManager",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "new_plugin_manager",
    "reset_plugin_manager",
]
