"""Core's own plugin, registered first: the default answers of the decision hooks.

Its decision hooks are ``trylast``, so any installed plugin or run plugin that answers (non-``None``)
overrides them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smalti.core.intervals import interval_fires
from smalti.core.plugins.markers import hookimpl

if TYPE_CHECKING:
    from smalti.core.events import Event
    from smalti.core.state import State


@hookimpl(trylast=True)
def should_eval(state: State, event: Event) -> bool | None:
    """Evaluate when ``state.eval_interval`` fires at this event, and once at fit end if the last batch was not evaluated."""
    if state.eval_interval is None or not state.evaluators:
        return False
    if event == "fit_end":
        return state.last_eval_batch != state.timestamp.batch
    return interval_fires(state.eval_interval, state, event)


@hookimpl
def smalti_config_schemas() -> dict[str, type]:
    """Schemas of the ``trainer`` and ``data`` sections and of core's components (checked before building)."""
    from smalti.core.config.core_schemas import schemas

    return schemas()
