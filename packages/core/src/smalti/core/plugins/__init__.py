"""smalti's plugin system: pluggy markers, the hookspecs, the plugin manager and the plugin base classes.

Hook implementations are marked with :data:`hookimpl` (or are spec-named methods of a :class:`Callback`,
:class:`Algorithm` or :class:`LoggerDestination` subclass). A package that must not import smalti-core may
make the same marker itself with ``pluggy.HookimplMarker("smalti")``.
"""

from smalti.core.plugins.base import Algorithm, Callback, LoggerDestination, SmaltiPlugin
from smalti.core.plugins.manager import (
    SmaltiPluginManager,
    get_plugin_manager,
    new_plugin_manager,
    reset_plugin_manager,
)
from smalti.core.plugins.markers import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
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
