"""Every hookspec is called somewhere in smalti-core, and ``smalti_addhooks`` works as documented."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest

from smalti.core.errors import PluginError
from smalti.core.events import Event
from smalti.core.plugins import SmaltiPluginManager, hookimpl, hookspec, hookspecs

SRC = Path(__file__).resolve().parents[1] / "src" / "smalti" / "core"
#: Where hooks are specified or given defaults, not called.
NOT_CALLERS = {"plugins/hookspecs.py", "plugins/base.py", "events.py"}


def _spec_names() -> set[str]:
    return {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if fn.__module__ == hookspecs.__name__ and hasattr(fn, "smalti_spec")}


def _called_hook_names(src: Path) -> set[str]:
    """Hook names the sources call: ``<...hook...>.<name>``, ``"<name>"`` (a hook looked up by name),
    ``Event.<MEMBER>`` and ``<events>.fire("<value>")`` (dispatched as ``on_<value>``); implementations do not
    count."""
    names: set[str] = set()
    for path in src.rglob("*.py"):
        if path.relative_to(src).as_posix() in NOT_CALLERS:
            continue
        tree = ast.parse(path.read_text())
        # @hookimpl(specname="on_x") implements a hook, it does not call it
        implements = {id(kw.value) for kw in ast.walk(tree) if isinstance(kw, ast.keyword) and kw.arg == "specname"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fire":
                first = node.args[0] if node.args else None  # events.fire("exception"): on_exception
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(f"on_{first.value}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in implements:
                names.add(node.value)
            elif isinstance(node, ast.Attribute):
                owner = ast.unparse(node.value)
                if owner == "Event" and node.attr in Event.__members__:
                    names.add(Event[node.attr].hook_name)
                elif "hook" in owner.lower():
                    names.add(node.attr)
    return names


def test_every_hookspec_has_a_caller() -> None:
    specs = _spec_names()
    assert len(specs) > 40  # the scan finds the specs at all
    assert sorted(specs - _called_hook_names(SRC)) == []


class _ExtraSpecs:
    @hookspec
    def on_custom(self, state):
        """A package's own hook."""


def _adder_module() -> types.ModuleType:
    module = types.ModuleType("smalti_test_addhooks")

    def smalti_addhooks(pluginmanager):
        pluginmanager.add_hookspecs(_ExtraSpecs)

    smalti_addhooks.__module__ = module.__name__
    module.smalti_addhooks = smalti_addhooks
    return module


class _Implementer:
    @hookimpl
    def on_custom(self, state):
        return f"custom {state}"


@pytest.mark.parametrize("adder_first", [True, False])
def test_addhooks_adds_a_packages_own_specs(adder_first: bool) -> None:
    pm = SmaltiPluginManager()
    plugins = [_adder_module(), _Implementer()]
    for plugin in plugins if adder_first else reversed(plugins):
        pm.register(plugin)
    pm.check_unknown_hooks()  # on_custom has a spec now, whichever registered first
    assert pm.hook.on_custom.spec is not None
    assert pm.hook.on_custom(state=3) == ["custom 3"]


def test_without_addhooks_the_unknown_hook_is_refused() -> None:
    pm = SmaltiPluginManager()
    pm.register(_Implementer())
    with pytest.raises(PluginError, match="on_custom"):
        pm.check_unknown_hooks()
