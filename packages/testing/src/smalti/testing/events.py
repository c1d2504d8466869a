"""``EventRecorder``: a plugin that records every event hook the trainer calls, in order."""

from __future__ import annotations

from typing import Any


def _event_hook_names() -> list[str]:
    from smalti.core.plugins import hookspecs

    return [name for name in vars(hookspecs) if name.startswith("on_")]


class EventRecorder:
    """Register it with the trainer (as a callback) and read ``events``: hook names without the ``on_`` prefix.

    Built on first use from core's hookspecs, so it records every event hook that exists.
    """

    events: list[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> EventRecorder:
        if not getattr(cls, "_built", False):
            for name in _event_hook_names():
                setattr(cls, name, _recorder(name))
            cls._built = True
        return super().__new__(cls)

    def __init__(self, record_eval: bool = True) -> None:
        self.events = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.record_eval = record_eval


def _recorder(name: str):
    event = name.removeprefix("on_")
    if name == "on_exception":

        def hook(self: EventRecorder, state: Any, logger: Any, exc: BaseException) -> None:
            self.events.append(event)
            self.calls.append((event, {"exc": exc}))

    elif name == "on_microbatch_size_change":

        def hook(self: EventRecorder, state: Any, logger: Any, old: int, new: int) -> None:  # type: ignore[misc]
            self.events.append(event)
            self.calls.append((event, {"old": old, "new": new}))

    else:

        def hook(self: EventRecorder, state: Any, logger: Any) -> None:  # type: ignore[misc]
            self.events.append(event)

    hook.__name__ = name
    from smalti.core.plugins import hookimpl

    return hookimpl(hook)
