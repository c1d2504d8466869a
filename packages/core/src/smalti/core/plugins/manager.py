"""Plugin managers: one per Trainer, built from entry points discovered once per process; typo checks.

In an entry-point module, a plain function named after a hookspec is a hook (as pytest treats ``pytest_*``
functions); a function that looks like a hook (``on_*``, ``should_*``, ``smalti_*``, ``log_*``, the state
hooks) but matches no hookspec fails at start, naming the function and the closest hook.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import inspect
import logging
import os
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from smalti.core.errors import PluginError
from smalti.core.plugins import hookspecs
from smalti.core.plugins.base import SmaltiPlugin
from smalti.core.plugins.markers import ENTRY_POINT_GROUP, PROJECT_NAME

log = logging.getLogger(__name__)

DISABLE_AUTOLOAD_ENV = "SMALTI_DISABLE_PLUGIN_AUTOLOAD"
ALLOWED_ENV = "SMALTI_PLUGINS"
DISABLED_ENV = "SMALTI_DISABLED_PLUGINS"
TRACE_ENV = "SMALTI_TRACE_PLUGINS"

_HOOK_PREFIXES = ("on_", "should_")
#: What a plain function in a plugin module must look like to be taken for a hook (and checked against the specs).
_MODULE_HOOK_PREFIXES = ("on_", "should_", "smalti_", "log_")
_DEFAULT_OPTS = {"wrapper": False, "hookwrapper": False, "optionalhook": False, "tryfirst": False,
                 "trylast": False, "specname": None}
_EXTRA_HOOK_NAMES = ("plugin_state_dict", "load_plugin_state_dict", "log_metrics", "log_hyperparameters", "log_artifact")


@dataclass(frozen=True)
class PluginInfo:
    """Where an entry-point plugin came from, for ``smalti plugins`` and error messages."""

    name: str
    distribution: str
    version: str
    entry_point: str
    location: str


def _env_list(name: str) -> set[str]:
    return {item.strip() for item in os.environ.get(name, "").split(",") if item.strip()}


class SmaltiPluginManager(pluggy.PluginManager):
    """pluggy's manager with smalti's rules: base-class methods are hooks, typos fail, entry points are guarded."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        # As pytest fires pytest_addhooks: every plugin registered from now on may add hookspecs of its own
        # before its (and later plugins') hook names are checked.
        self.hook.smalti_addhooks.call_historic(kwargs={"pluginmanager": self})
        self.entry_point_info: dict[str, PluginInfo] = {}
        if os.environ.get(TRACE_ENV):
            self.trace.root.setwriter(log.info)
            self.enable_tracing()

    # pluggy calls this for every attribute of a registered plugin.
    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and isinstance(plugin, types.ModuleType):
            return self._plain_module_function(plugin, name)
        if not isinstance(plugin, SmaltiPlugin):
            return opts
        if opts is None:
            if name.startswith("_") or name in plugin.not_hooks:
                return None
            if not (name.startswith(_HOOK_PREFIXES) or name in _EXTRA_HOOK_NAMES):
                return None
            method = getattr(plugin, name, None)
            if not inspect.ismethod(method):
                return None
            if not self._overridden(plugin, name):
                return None
            opts = dict(_DEFAULT_OPTS)
        else:
            opts = dict(opts)
        if not (opts.get("tryfirst") or opts.get("trylast")):
            opts.update(plugin.role_order)
        return opts  # type: ignore[return-value]

    def _plain_module_function(self, module: types.ModuleType, name: str) -> pluggy.HookimplOpts | None:
        """A function defined in a plugin module is a hook when a spec has its name or it looks like a hook."""
        if name.startswith("_"):
            return None
        func = getattr(module, name, None)
        if not inspect.isfunction(func) or func.__module__ != module.__name__:
            return None
        caller = getattr(self.hook, name, None)
        is_spec = caller is not None and caller.spec is not None
        if not (is_spec or name.startswith(_MODULE_HOOK_PREFIXES) or name in _EXTRA_HOOK_NAMES):
            return None
        return dict(_DEFAULT_OPTS)  # type: ignore[return-value]

    @staticmethod
    def _overridden(plugin: SmaltiPlugin, name: str) -> bool:
        """A hook method inherited unchanged from a smalti base class is a default, not an implementation."""
        from smalti.core.plugins import base

        defined_on = next(cls for cls in type(plugin).__mro__ if name in vars(cls))
        return defined_on.__module__ != base.__name__

    def check_unknown_hooks(self, plugin: Any | None = None) -> None:
        """Like pluggy's ``check_pending`` but with a message that names the plugin and suggests the right hook."""
        known = [n for n in dir(self.hook) if not n.startswith("_")]
        for hook_name in known:
            caller = getattr(self.hook, hook_name)
            if caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if plugin is not None and impl.plugin is not plugin:
                    continue
                if impl.optionalhook:
                    continue
                spec_names = [n for n in known if getattr(self.hook, n).spec is not None]
                close = difflib.get_close_matches(hook_name, spec_names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.unregister(impl.plugin)
                raise PluginError(
                    f"plugin {impl.plugin_name!r} implements {hook_name!r}, which is not a smalti hook{hint} "
                    "(the hookspecs are listed in smalti.core.plugins.hookspecs)"
                )

    def load_entry_points(self) -> None:
        """Register every installed ``smalti`` entry point (discovered once per process), then check hook names."""
        for name, plugin, info in discover_entry_points():
            if self.get_plugin(name) is not None or self.is_registered(plugin):
                continue
            self.register(plugin, name=name)
            self.entry_point_info[name] = info
        self.check_unknown_hooks()

    def config_searchpaths(self) -> list[str]:
        """Every path returned by ``smalti_config_searchpath``, in plugin-name order, without repeats."""
        paths: list[str] = []
        for result in reversed(self.hook.smalti_config_searchpath()):
            for path in [result] if isinstance(result, str) else list(result or []):
                if path not in paths:
                    paths.append(path)
        return paths

    def implemented_hooks(self, plugin: Any) -> list[str]:
        """Names of the hooks ``plugin`` implements."""
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or [])

    def register_run_plugins(self, groups: Iterable[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Register the run's algorithms, callbacks and loggers (each a ``name -> object`` dict) for one run.

        Objects are registered in reverse so that, pluggy being LIFO, they run in config order. Returns the
        registered objects so the caller can :meth:`unregister_run_plugins` them after the run.
        """
        registered: list[Any] = []
        for _role, objects in groups:
            for name, obj in reversed(list(objects.items())):
                if self.is_registered(obj):
                    continue
                reg_name = name if self.get_plugin(name) is None else f"{name}-{id(obj):x}"
                self.register(obj, name=reg_name)
                registered.append(obj)
                self.check_unknown_hooks(obj)
        return registered

    def unregister_run_plugins(self, objects: Iterable[Any]) -> None:
        for obj in objects:
            if self.is_registered(obj):
                self.unregister(obj)


_DISCOVERED: dict[tuple[str, str, str], list[tuple[str, Any, PluginInfo]]] = {}


def discover_entry_points() -> list[tuple[str, Any, PluginInfo]]:
    """The installed ``smalti`` entry points as ``(name, loaded object, info)``, sorted by name, honouring the
    allow and block lists. Loaded once per process (per setting of those variables)."""
    key = (os.environ.get(DISABLE_AUTOLOAD_ENV, ""), os.environ.get(ALLOWED_ENV, ""), os.environ.get(DISABLED_ENV, ""))
    if key in _DISCOVERED:
        return _DISCOVERED[key]
    found: list[tuple[str, Any, PluginInfo]] = []
    if not key[0]:
        allowed = _env_list(ALLOWED_ENV)
        disabled = _env_list(DISABLED_ENV)
        seen: set[str] = set()
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in seen:
                continue
            seen.add(ep.name)
            dist = ep.dist
            dist_name = dist.name if dist is not None else "?"
            if ep.name in disabled or dist_name in disabled:
                log.debug("plugin %s (%s) disabled by %s", ep.name, dist_name, DISABLED_ENV)
                continue
            if allowed and ep.name not in allowed and dist_name not in allowed:
                continue
            version = dist.version if dist is not None else "?"
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"entry point {ep.name!r} ({ep.value}) of {dist_name} {version} failed to import: {exc!r}; "
                    f"set {DISABLED_ENV}={ep.name} to skip it"
                ) from exc
            location = getattr(plugin, "__file__", None) or repr(plugin)
            found.append((ep.name, plugin, PluginInfo(ep.name, dist_name, version, ep.value, location)))
            log.debug("loaded plugin %s from %s %s", ep.name, dist_name, version)
    _DISCOVERED[key] = found
    return found


def new_plugin_manager() -> SmaltiPluginManager:
    """A fresh manager for one run: core's builtin plugin plus every installed entry point.

    Each :class:`~smalti.core.trainer.Trainer` builds its own, so two trainers in one process never see each
    other's plugins; only the entry-point scan (:func:`discover_entry_points`) is shared.
    """
    from smalti.core import plugin as core_plugin

    manager = SmaltiPluginManager()
    manager.register(core_plugin, name="core")
    manager.load_entry_points()
    return manager


_MANAGER: SmaltiPluginManager | None = None


def get_plugin_manager() -> SmaltiPluginManager:
    """The process's discovery manager (config search path, ``smalti plugins``); runs never register in it."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = new_plugin_manager()
    return _MANAGER


def reset_plugin_manager() -> None:
    """Forget the process's discovery manager and entry-point scan (tests; a changed environment)."""
    global _MANAGER
    _MANAGER = None
    _DISCOVERED.clear()
