"""The trainer's events in the order they fire (:class:`Event`), and :class:`Events`, the one way the loop fires
its hooks."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

from smalti.core.dispatch import FastHook

if TYPE_CHECKING:
    import pluggy

    from smalti.core.logger import Logger
    from smalti.core.state import State


class Event(StrEnum):
    """Every event hook the trainer calls, named as its hookspec (``on_<value>``)."""

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    MICROBATCH_START = "microbatch_start"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    MICROBATCH_END = "microbatch_end"
    #: Called with an extra ``recompute`` argument (``Events.fire(Event.GRADIENTS_READY, recompute=...)``).
    GRADIENTS_READY = "gradients_ready"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    FIT_END = "fit_end"
    CLOSE = "close"

    # hashed as its value (a str, so equal to it anyway), in C: the loop looks events up every step
    __hash__ = str.__hash__

    @property
    def hook_name(self) -> str:
        """The hookspec this event dispatches to."""
        return f"on_{self.value}"


MICROBATCH_EVENTS = (
    Event.MICROBATCH_START,
    Event.BEFORE_FORWARD,
    Event.AFTER_FORWARD,
    Event.BEFORE_LOSS,
    Event.AFTER_LOSS,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.MICROBATCH_END,
)

EVAL_EVENTS = (
    Event.EVAL_START,
    Event.EVAL_BATCH_START,
    Event.EVAL_BEFORE_FORWARD,
    Event.EVAL_AFTER_FORWARD,
    Event.EVAL_BATCH_END,
    Event.EVAL_END,
)

#: The decision hooks the loop asks (``firstresult``: the first answer wins).
DECISIONS = ("should_eval", "should_checkpoint", "should_stop")


class Events:
    """Fires the hooks of one trainer's loop: ``fire`` for the event hooks, ``decide`` for the decision hooks.

    ``fire(Event.BATCH_END)`` calls ``on_batch_end`` with the run's ``state`` and ``logger`` (plus the extra
    arguments a hook takes: ``fire("exception", exc=exc)``); ``decide("should_eval", event=Event.BATCH_END)``
    asks a ``should_*`` hook with ``state`` and returns the first answer (``None`` when nobody answers). Which
    dispatcher runs the implementations (:class:`~smalti.core.dispatch.FastHook` or, for hook wrappers, tracing
    and monitoring, pluggy) is this object's business; a hook no plugin implements costs a lookup and no call.
    Either way :func:`smalti.core.dispatch.current_hook` tells which implementation runs.
    """

    __slots__ = ("_pm", "_state", "_logger", "_hooks")

    def __init__(self, pm: pluggy.PluginManager, state: State, logger: Logger) -> None:
        self._pm, self._state, self._logger = pm, state, logger
        self._hooks: dict[str, FastHook] = {}
        for event in Event:  # made up front: the loop's lookups never miss
            self.hook(event.hook_name)
            self._hooks[event] = self._hooks[event.hook_name]
        for name in DECISIONS:
            self.hook(name)

    def hook(self, name: str) -> FastHook:
        """The dispatcher of hook ``name`` (``on_batch_end``, ``should_eval``): its ``impls`` say who implements it."""
        hook = self._hooks.get(name)
        if hook is None:
            hook = self._hooks[name] = FastHook(self._pm, name)
        return hook

    def fire(self, event: Event | str, **extra: Any) -> None:
        """Call ``on_<event>(state, logger, **extra)`` on every plugin that implements it, in plugin order."""
        try:
            hook = self._hooks[event]
        except KeyError:
            hook = self._hooks[event] = self.hook(f"on_{event}")
        if hook.impls:  # most events have no implementation
            hook(state=self._state, logger=self._logger, **extra)

    def decide(self, name: str, **kwargs: Any) -> Any:
        """Ask decision hook ``name`` (``should_*``, given ``state`` and ``kwargs``): the first non-``None`` answer."""
        try:
            hook = self._hooks[name]
        except KeyError:
            hook = self.hook(name)
        if not hook.impls:
            return None
        return hook(state=self._state, **kwargs)
