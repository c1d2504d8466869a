"""smalti's pluggy project name and markers: the one module hookspecs, the manager and plugins all build on."""

import pluggy

PROJECT_NAME = "smalti"
ENTRY_POINT_GROUP = "smalti"

#: Marks a hookspec (in :mod:`smalti.core.plugins.hookspecs`, or a package's own added by ``smalti_addhooks``).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a hook implementation (spec-named methods of the plugin base classes need none).
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
