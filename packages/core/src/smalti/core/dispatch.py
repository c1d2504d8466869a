"""Calling a hook from the training loop for a few hundred nanoseconds instead of pluggy's few microseconds.

The loop calls about twenty hooks every step, most of which no plugin implements, and pluggy's call machinery
(argument checks, a copy of the implementation list, ``_multicall``'s wrapper handling) costs more than the
work of a short hook. :class:`FastHook` calls the implementations the way ``_multicall`` does (last registered
first, each with the arguments it names, stopping at the first non-``None`` answer of a ``firstresult`` hook)
and hands the call to pluggy whenever pluggy would do something more: hook wrappers, tracing or call
monitoring (``PluginManager.enable_tracing``, ``add_hookcall_monitoring``). The implementation list is
re-read whenever it changes, so plugins registered or unregistered mid-run are seen at the next call.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from operator import itemgetter
from types import CodeType, FrameType
from typing import Any

import pluggy

from smalti.core._compat import PLAIN_HOOKEXEC as _PLAIN_HOOKEXEC
from smalti.core._compat import hook_impls


class FastHook:
    """One hook of ``pm``, callable as ``hook(**kwargs)`` with pluggy's semantics and without its overhead."""

    __slots__ = ("_caller", "_pm", "_seen", "_calls", "_first", "_name", "impls")

    def __init__(self, pm: pluggy.PluginManager, name: str) -> None:
        self._caller = getattr(pm.hook, name)
        self._name = name
        #: The hook's implementations: pluggy's own list, changed in place as plugins come and go (empty: no
        #: plugin implements the hook, and a caller may skip the call).
        self.impls: list[Any] = hook_impls(self._caller)
        self._pm = pm
        self._seen: list[Any] | None = None
        self._calls: list[tuple[Any, Any, int, Any]] | None = None
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
            self._seen = list(impls)
            plain = not any(impl.hookwrapper or impl.wrapper for impl in impls)
            self._calls = [_plan(impl) for impl in reversed(impls)] if plain else None
        # pm._inner_hookexec read directly (smalti.core._compat checked the field at import): a function call
        # here would cost more than the rest of the fast path
        if self._calls is None or self._pm._inner_hookexec is not _PLAIN_HOOKEXEC:
            return self._caller(**kwargs)
        # Named as in pluggy's _multicall, so that running_hooks() reads both kinds of frame alike.
        hook_name, hook_impls = self._name, impls  # noqa: F841
        # Arguments picked without building a list per call: one name is a key, more an itemgetter.
        if self._first:
            for hook_impl, function, n, pick in self._calls:  # noqa: B007
                result = function(kwargs[pick]) if n == 1 else function(*pick(kwargs)) if n else function()
                if result is not None:
                    return result
            return None
        results = []
        for hook_impl, function, n, pick in self._calls:  # noqa: B007
            result = function(kwargs[pick]) if n == 1 else function(*pick(kwargs)) if n else function()
            if result is not None:
                results.append(result)
        return results


def _plan(impl: Any) -> tuple[Any, Any, int, Any]:
    """``(impl, its function, how many arguments it names, how to pick them from the call's kwargs)``."""
    names = tuple(impl.argnames)
    pick = names[0] if len(names) == 1 else itemgetter(*names) if names else None
    return impl, impl.function, len(names), pick


@dataclass(frozen=True)
class RunningHook:
    """A hook call in progress on some thread: the hook, the implementation running now and its place.

    ``impl_index`` counts in call order (0 = called first; -1 when not known); ``plugin`` is the object whose
    method runs (``None`` for a plain function); ``where`` names the running code (``Class.method``).
    """

    hook: str
    plugin: Any
    where: str
    impl_index: int


def _hook_call_codes() -> tuple[CodeType, ...]:
    """The code objects that call hook implementations: pluggy's (a plugin manager's plain hook executor,
    ``_multicall``) and :meth:`FastHook.__call__`."""
    return (FastHook.__call__.__code__, _PLAIN_HOOKEXEC.__code__)


def running_hooks(thread_id: int) -> list[RunningHook]:
    """The hooks thread ``thread_id`` is running now, outermost first (for a hang report: costs nothing until
    asked). The one place that knows how a hook call looks on a live stack, so callers (smalti-health's
    watchdog) depend on this function, not on the names of this module's or pluggy's internals."""
    frame: FrameType | None = sys._current_frames().get(thread_id)
    chain: list[FrameType] = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    chain.reverse()
    if not chain:  # the thread has ended
        return []
    codes = _hook_call_codes()
    running = []
    for outer, inner in zip(chain, [*chain[1:], None], strict=True):
        if outer.f_code not in codes:
            continue
        local = outer.f_locals
        if "hook_name" not in local:  # a FastHook that handed the call to pluggy: pluggy's frame follows
            continue
        impls, current = list(local.get("hook_impls") or ()), local.get("hook_impl")
        # implementations run last-registered first: the index says how far through the hook the thread got
        order = next((len(impls) - 1 - i for i, impl in enumerate(impls) if impl is current), -1)
        plugin = inner.f_locals.get("self") if inner is not None else None
        code = inner.f_code.co_name if inner is not None else "?"
        where = f"{type(plugin).__name__}.{code}" if plugin is not None else code
        running.append(RunningHook(str(local.get("hook_name")), plugin, where, order))
    return running
