"""The trainer's events in the order they fire: the documented order that tests check the loop against."""

from enum import StrEnum


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
    #: Called with an extra ``recompute`` argument, and only when some plugin implements it (not via ``_event``).
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
