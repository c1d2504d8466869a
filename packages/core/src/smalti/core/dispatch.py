"""Calling a hook from the training loop for a few hundred nanoseconds instead of pluggy's few microseconds, and
knowing, from any thread, which hook implementation a thread is running.

The loop calls about twenty hooks every step, most of which no plugin implements, and pluggy's call machinery
(argument checks, a copy of the implementation list, ``_multicall``'s wrapper handling) costs more than the
work of a short hook. :class:`FastHook` calls the implementations the way pluggy does (last registered first,
each with the arguments it names, stopping at the first non-``None`` answer of a ``firstresult`` hook) and hands
the call to pluggy whenever pluggy would do something more: hook wrappers, tracing or call monitoring
(``PluginManager.enable_tracing``, ``add_hookcall_monitoring``). The implementation list is re-read whenever it
changes, so plugins registered or unregistered mid-run are seen at the next call.

Both ways record the implementation that runs: around each implementation's call the calling thread's
:class:`HookCall` chain is set (and put back after), readable in the same thread with :func:`current_hook` and
from another thread (the hang watchdog) with :func:`running_hooks`. When pluggy dispatches, the plain
implementations are handed to it through its public ``call_extra`` (wrapped to record themselves) and the hook
wrappers stay pluggy's; a thread inside a wrapper is reported in the hook, with the wrappers' plugins named.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import pluggy

from smalti.core._compat import PLAIN_HOOKEXEC as _PLAIN_HOOKEXEC
from smalti.core._compat import hook_impls


@dataclass(frozen=True, slots=True)
class HookCall:
    """One hook implementation being run: the hook, the plugin it belongs to and its place in the call order.

    ``impl_index`` counts in call order (0 = called first; -1 for the hook's wrappers as a whole, when a thread
    is in a hook wrapper rather than in one implementation); ``plugin`` is the object whose method runs (the
    module for a plain function, ``None`` for wrappers as a whole); ``plugin_name`` is its registered name;
    ``where`` names the running code (``Class.method``, or ``module.function``).
    """

    hook: str
    plugin: Any
    plugin_name: str | None
    where: str
    impl_index: int


class _ThreadCalls:
    """One thread's hook calls in progress: ``current`` is ``(innermost HookCall, the chain around it)`` or ``()``.

    Set and put back with attribute stores, which cost no function call on the loop's hot path.
    """

    __slots__ = ("current", "__weakref__")

    def __init__(self) -> None:
        self.current: tuple = ()


_local = threading.local()
#: thread id -> that thread's calls (dropped with the thread: the thread-local holds the only strong reference)
_registry: weakref.WeakValueDictionary[int, _ThreadCalls] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def _thread_calls() -> _ThreadCalls:
    """This thread's :class:`_ThreadCalls`, made and registered on first use."""
    try:
        return _local.calls
    except AttributeError:
        calls = _local.calls = _ThreadCalls()
        with _registry_lock:
            _registry[threading.get_ident()] = calls
        return calls


def _chain(current: tuple) -> list[HookCall]:
    calls = []
    while current:
        call, current = current
        calls.append(call)
    calls.reverse()
    return calls


def current_hook() -> HookCall | None:
    """The hook implementation the calling code runs inside (the innermost when hooks nest), ``None`` outside."""
    current = _thread_calls().current
    return current[0] if current else None


def running_hooks(thread_id: int) -> list[HookCall]:
    """The hook implementations thread ``thread_id`` is inside now, outermost first (``[]`` when none or the
    thread has ended). For a hang report read from another thread; costs the traced thread nothing until asked."""
    calls = _registry.get(thread_id)
    return _chain(calls.current) if calls is not None else []


def _describe(impl: Any, hook: str, index: int) -> HookCall:
    """The :class:`HookCall` that ``impl`` (a ``pluggy.HookImpl``) of ``hook`` runs as, ``index``-th in call order."""
    function = impl.function
    owner = getattr(function, "__self__", None)
    name = getattr(function, "__name__", hook)
    if owner is not None:
        where = f"{type(owner).__name__}.{name}"
    else:
        where = f"{getattr(function, '__module__', None) or '?'}.{name}"
    return HookCall(hook, impl.plugin, impl.plugin_name, where, index)


def _recording(call: HookCall, function: Any) -> Any:
    """``function``, recording ``call`` around each of its calls (for implementations pluggy calls)."""

    @functools.wraps(function)  # pluggy reads the argument names through __wrapped__
    def run(*args: Any) -> Any:
        calls = _thread_calls()
        outer = calls.current
        # inside a wrapped hook the implementation stands for the wrappers' entry rather than nesting under it
        base = outer[1] if outer and outer[0].impl_index == -1 and outer[0].hook == call.hook else outer
        calls.current = (call, base)
        try:
            return function(*args)
        finally:
            calls.current = outer

    return run


class FastHook:
    """One hook of ``pm``, callable as ``hook(**kwargs)`` with pluggy's semantics and without its overhead."""

    __slots__ = ("_caller", "_pm", "_seen", "_calls", "_via_pluggy", "_first", "_name", "impls")

    def __init__(self, pm: pluggy.PluginManager, name: str) -> None:
        self._caller = getattr(pm.hook, name)
        self._name = name
        #: The hook's implementations: pluggy's own list, changed in place as plugins come and go (empty: no
        #: plugin implements the hook, and a caller may skip the call).
        self.impls: list[Any] = hook_impls(self._caller)
        self._pm = pm
        self._seen: list[Any] | None = None
        self._calls: list[tuple[HookCall, Any, int, Any]] | None = None
        self._via_pluggy: _PluggyCall | None = None
        spec = self._caller.spec
        self._first = bool(spec is not None and spec.opts.get("firstresult"))

    def implemented(self) -> bool:
        """Whether any plugin implements the hook now."""
        return bool(self.impls)

    def __call__(self, **kwargs: Any) -> Any:
        impls = self.impls
        if not impls:
            return None if self._first else []
        if impls != self._seen:
            self._replan(impls)
        # pm._inner_hookexec read directly (smalti.core._compat checked the field at import): a function call
        # here would cost more than the rest of the fast path
        if self._calls is None or self._pm._inner_hookexec is not _PLAIN_HOOKEXEC:
            return self._pluggy_call(kwargs)
        try:
            thread = _local.calls
        except AttributeError:
            thread = _thread_calls()
        outer = thread.current
        # Arguments picked without building a list per call: one name is a key, more an itemgetter.
        try:
            if self._first:
                for call, function, n, pick in self._calls:
                    thread.current = (call, outer)
                    result = function(kwargs[pick]) if n == 1 else function(*pick(kwargs)) if n else function()
                    if result is not None:
                        return result
                return None
            results = []
            for call, function, n, pick in self._calls:
                thread.current = (call, outer)
                result = function(kwargs[pick]) if n == 1 else function(*pick(kwargs)) if n else function()
                if result is not None:
                    results.append(result)
            return results
        finally:
            thread.current = outer

    def _replan(self, impls: list[Any]) -> None:
        """Re-read the implementation list after a plugin came or went."""
        self._seen = list(impls)
        plain = not any(impl.hookwrapper or impl.wrapper for impl in impls)
        last = len(impls) - 1
        # pluggy calls the last registered first: index 0 is impls[-1]
        self._calls = (
            [_plan(impls[i], _describe(impls[i], self._name, last - i)) for i in range(last, -1, -1)] if plain else None
        )
        self._via_pluggy = None

    def _pluggy_call(self, kwargs: dict[str, Any]) -> Any:
        if self._via_pluggy is None:
            self._via_pluggy = _PluggyCall(self._pm, self._caller, self._name, list(self.impls))
        return self._via_pluggy(kwargs)


class _PluggyCall:
    """A hook call pluggy runs (wrappers, tracing or monitoring), its plain implementations recording themselves.

    The plain implementations' plugins are taken out with ``subset_hook_caller`` and their functions, wrapped by
    :func:`_recording`, put back in the same order with ``call_extra`` (both public pluggy API); the wrappers
    run as pluggy runs them, and a thread inside one of them is reported in the hook with the wrappers' plugins.
    """

    __slots__ = ("_subset", "_functions", "_wrappers", "_caller")

    def __init__(self, pm: pluggy.PluginManager, caller: Any, name: str, impls: list[Any]) -> None:
        self._caller = caller
        last = len(impls) - 1
        plain = [(last - i, impl) for i, impl in enumerate(impls) if not (impl.hookwrapper or impl.wrapper)]
        wrapped = [impl for impl in impls if impl.hookwrapper or impl.wrapper]
        names = ", ".join(str(impl.plugin_name) for impl in reversed(wrapped))
        self._wrappers = HookCall(name, None, names or None, f"hook wrappers of {names}", -1) if wrapped else None
        owners = {impl.plugin for _, impl in plain}
        if owners & {impl.plugin for impl in wrapped} or caller.is_historic():
            # a plugin with both a wrapper and an implementation of this hook cannot be taken apart: pluggy calls
            # it whole, and the report names the hook and the wrappers only
            self._subset, self._functions = None, []
            return
        self._subset = pm.subset_hook_caller(name, owners)
        # call_extra lists each extra function after the previous ones, and pluggy calls the list from its end:
        # handed over last-called first
        self._functions = [_recording(_describe(impl, name, index), impl.function)
                           for index, impl in sorted(plain, key=itemgetter(0), reverse=True)]

    def __call__(self, kwargs: dict[str, Any]) -> Any:
        thread = _thread_calls()
        outer = thread.current
        if self._wrappers is not None:
            thread.current = (self._wrappers, outer)
        try:
            if self._subset is None:
                return self._caller(**kwargs)
            return self._subset.call_extra(self._functions, kwargs)
        finally:
            thread.current = outer


def _plan(impl: Any, call: HookCall) -> tuple[HookCall, Any, int, Any]:
    """``(what runs, the function, how many arguments it names, how to pick them from the call's kwargs)``."""
    names = tuple(impl.argnames)
    pick = names[0] if len(names) == 1 else itemgetter(*names) if names else None
    return call, impl.function, len(names), pick
