"""Adds the repository's ``conf/`` (first) and every installed smalti package's config path (last).

Only for smalti's own apps (whose primary config is ``pkg://smalti.core.conf``): other Hydra apps in the
same environment are left alone. Kept import-light: every Hydra app imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CORE_CONF = "pkg://smalti.core.conf"
CONF_DIR_ENV = "SMALTI_CONF_DIR"


def repo_conf_dir() -> Path | None:
    """``$SMALTI_CONF_DIR``, else ``./conf`` when it exists."""
    configured = os.environ.get(CONF_DIR_ENV)
    if configured:
        return Path(configured).resolve()
    local = Path.cwd() / "conf"
    return local.resolve() if local.is_dir() else None


class SmaltiSearchPathPlugin(SearchPathPlugin):
    """Hydra search-path plugin: repository ``conf/`` prepended, ``smalti_config_searchpath`` results appended."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not any(element.path == CORE_CONF for element in search_path.get_path()):
            return
        conf = repo_conf_dir()
        if conf is not None:
            search_path.prepend(provider="smalti-repo", path=f"file://{conf}")
        from smalti.core.plugins import get_plugin_manager

        for path in get_plugin_manager().config_searchpaths():
            search_path.append(provider="smalti-plugin", path=path)
