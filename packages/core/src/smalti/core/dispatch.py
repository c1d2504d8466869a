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

from operator import itemgetter
from typing import Any

import pluggy

#: What a plugin manager runs hooks with when nobody traces or monitors them (pluggy's ``_multicall``).
_PLAIN_HOOKEXEC = pluggy.PluginManager("smalti-dispatch-probe")._inner_hookexec


class FastHook:
    """One hook of ``pm``, callable as ``hook(**kwargs)`` with pluggy's semantics and without its overhead."""

    __slots__ = ("_caller", "_pm", "_seen", "_calls", "_first", "_name", "impls")

    def __init__(self, pm: pluggy.PluginManager, name: str) -> None:
        self._caller = getattr(pm.hook, name)
        self._name = name
        #: The hook's implementations: pluggy's own list, changed in place as plugins come and go (empty: no
        #: plugin implements the hook, and a caller may skip the call).
        self.impls: list[Any] = self._caller._hookimpls
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
        if self._calls is None or self._pm._inner_hookexec is not _PLAIN_HOOKEXEC:
            return self._caller(**kwargs)
        # Named as in pluggy's _multicall: smalti-health's watchdog reads them from a hung rank's live stack to
        # say which hook and which plugin it is stuck in.
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
