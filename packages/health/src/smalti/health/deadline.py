"""Run a call that may never return (a wedged driver) under a deadline, from a thread the caller can abandon."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """The call did not return within its deadline; it keeps running in an abandoned daemon thread."""


def call_with_deadline(fn: Callable[..., T], *args: Any, deadline_s: float, what: str = "") -> T:
    """``fn(*args)``, or :class:`DeadlineExceeded` naming ``what`` after ``deadline_s`` seconds.

    A daemon thread per call, not a pool: a call stuck in the driver must not hold a worker that later
    calls would queue behind, and it must not keep the process alive at exit.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"smalti-health-call-{what or fn.__name__}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise DeadlineExceeded(f"{what or fn.__name__} did not return within {deadline_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
