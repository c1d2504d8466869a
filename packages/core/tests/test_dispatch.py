"""FastHook calls implementations exactly as pluggy does, and hands over to pluggy when it must."""

import pluggy
import pytest

from smalti.core.dispatch import FastHook

spec = pluggy.HookspecMarker("t")
impl = pluggy.HookimplMarker("t")


class Spec:
    @spec
    def on_event(self, state, logger):
        """An event."""

    @spec(firstresult=True)
    def should(self, state):
        """A decision."""


class Recorder:
    def __init__(self, name, calls, answer=None):
        self.name, self.calls, self.answer = name, calls, answer

    @impl
    def on_event(self, state):  # takes only what it names
        self.calls.append((self.name, state))
        return self.name

    @impl
    def should(self, state):
        self.calls.append(self.name)
        return self.answer


def manager(*plugins):
    pm = pluggy.PluginManager("t")
    pm.add_hookspecs(Spec)
    for p in plugins:
        pm.register(p)
    return pm


def test_same_order_arguments_and_results_as_pluggy():
    fast_calls, slow_calls = [], []
    fast = manager(*(Recorder(n, fast_calls) for n in "abc"))
    slow = manager(*(Recorder(n, slow_calls) for n in "abc"))
    assert FastHook(fast, "on_event")(state=1, logger=2) == slow.hook.on_event(state=1, logger=2)
    assert fast_calls == slow_calls == [("c", 1), ("b", 1), ("a", 1)]  # last registered first


def test_firstresult_stops_at_the_first_answer():
    calls = []
    pm = manager(Recorder("a", calls, answer=True), Recorder("b", calls, answer=None))
    assert FastHook(pm, "should")(state=0) is True
    assert calls == ["b", "a"]
    assert FastHook(manager(), "should")(state=0) is None
    assert FastHook(manager(), "on_event")(state=0, logger=0) == []


def test_plugins_registered_or_unregistered_later_are_seen():
    calls = []
    pm = manager(Recorder("a", calls))
    hook = FastHook(pm, "on_event")
    hook(state=0, logger=0)
    late = Recorder("late", calls)
    pm.register(late)
    hook(state=1, logger=0)
    pm.unregister(late)
    hook(state=2, logger=0)
    assert calls == [("a", 0), ("late", 1), ("a", 1), ("a", 2)]


def test_wrappers_and_monitoring_go_through_pluggy():
    calls, seen = [], []

    class Wrap:
        @impl(wrapper=True)
        def on_event(self, state):
            calls.append("before")
            result = yield
            calls.append("after")
            return result

    pm = manager(Recorder("a", calls), Wrap())
    FastHook(pm, "on_event")(state=0, logger=0)
    assert calls == ["before", ("a", 0), "after"]

    pm = manager(Recorder("a", []))
    hook = FastHook(pm, "on_event")
    hook(state=0, logger=0)
    undo = pm.add_hookcall_monitoring(lambda name, impls, kw: seen.append(name), lambda *a: None)
    hook(state=1, logger=0)
    undo()
    hook(state=2, logger=0)
    assert seen == ["on_event"]


def test_an_exception_propagates_and_stops_the_call():
    calls = []

    class Boom:
        @impl
        def on_event(self):
            raise ValueError("boom")

    pm = manager(Recorder("a", calls), Boom())
    with pytest.raises(ValueError, match="boom"):
        FastHook(pm, "on_event")(state=0, logger=0)
    assert calls == []


class Blocks:
    """An implementation that waits inside the hook until released, so another thread can look at it."""

    def __init__(self):
        import threading

        self.entered, self.release = threading.Event(), threading.Event()
        self.inside = None

    @impl
    def on_event(self, state):
        from smalti.core.dispatch import current_hook

        self.inside = current_hook()
        self.entered.set()
        self.release.wait(30)


class Wraps:
    def __init__(self):
        self.order = []

    @impl(wrapper=True)
    def on_event(self, state):
        self.order.append("before")
        result = yield
        self.order.append("after")
        return result


@pytest.mark.parametrize("path", ["fast", "pluggy"])
def test_running_hooks_names_the_hook_and_the_plugin_a_thread_is_in(path):
    """What the hang watchdog reports, on both ways a hook is called (FastHook's, and pluggy's when a wrapper
    makes FastHook hand over): read from another thread, and with current_hook() inside the implementation."""
    import threading

    from smalti.core.dispatch import current_hook, running_hooks

    blocker, calls = Blocks(), []
    plugins = [Recorder("a", calls), blocker] + ([Wraps()] if path == "pluggy" else [])
    pm = pluggy.PluginManager("t")
    pm.add_hookspecs(Spec)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    hook = FastHook(pm, "on_event")
    results = []
    worker = threading.Thread(target=lambda: results.append(hook(state=1, logger=None)), daemon=True)
    worker.start()
    try:
        assert blocker.entered.wait(30)
        (call,) = running_hooks(worker.ident)
        assert (call.hook, call.plugin, call.plugin_name, call.where) == ("on_event", blocker, "p1", "Blocks.on_event")
        assert call.impl_index == (0 if path == "fast" else 1)  # called first, or right after the wrapper
        assert blocker.inside == call  # the same record, read in the hook's own thread
        assert current_hook() is None and running_hooks(threading.get_ident()) == []  # this thread runs none
    finally:
        blocker.release.set()
        worker.join(30)
    assert running_hooks(worker.ident) == []
    # the implementations ran in pluggy's order either way: blocker first (registered after "a"), then "a"
    assert results == [["a"]] and calls == [("a", 1)]
    if path == "pluggy":
        assert plugins[2].order == ["before", "after"]


def test_a_thread_inside_a_hook_wrapper_is_reported_in_the_hook():
    """Outside the plain implementations, in a wrapper's code, the report names the hook and the wrappers."""
    import threading

    from smalti.core.dispatch import running_hooks

    entered, release = threading.Event(), threading.Event()

    class SlowWrapper:
        @impl(wrapper=True)
        def on_event(self, state):
            entered.set()
            release.wait(30)
            return (yield)

    pm = pluggy.PluginManager("t")
    pm.add_hookspecs(Spec)
    pm.register(Recorder("a", []), name="a")
    pm.register(SlowWrapper(), name="slow")
    hook = FastHook(pm, "on_event")
    worker = threading.Thread(target=lambda: hook(state=1, logger=None), daemon=True)
    worker.start()
    try:
        assert entered.wait(30)
        (call,) = running_hooks(worker.ident)
        assert (call.hook, call.plugin_name, call.impl_index) == ("on_event", "slow", -1)
    finally:
        release.set()
        worker.join(30)


def test_pluggy_path_keeps_order_firstresult_and_exceptions():
    """Handed to pluggy (a wrapper present), the plain implementations still run last registered first, a
    firstresult hook stops at the first answer, and an error propagates with the record put back."""
    from smalti.core.dispatch import current_hook

    calls = []
    pm = manager(Recorder("a", calls, answer=None), Recorder("b", calls, answer=True), Recorder("c", calls))

    class WrapShould:
        @impl(wrapper=True)
        def should(self, state):
            return (yield)

    pm.register(WrapShould())
    assert FastHook(pm, "should")(state=0) is True
    assert calls == ["c", "b"]
    order = []
    pm = manager(*(Recorder(n, order) for n in "abc"), Wraps())
    assert FastHook(pm, "on_event")(state=5, logger=0) == ["c", "b", "a"]
    assert order == [("c", 5), ("b", 5), ("a", 5)]

    class Boom:
        @impl
        def on_event(self):
            raise ValueError("boom")

    pm.register(Boom())
    with pytest.raises(ValueError, match="boom"):
        FastHook(pm, "on_event")(state=0, logger=0)
    assert current_hook() is None
