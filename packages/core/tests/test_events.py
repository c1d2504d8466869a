"""Every hook of the training loop is fired through the trainer's one ``Events`` object."""

from __future__ import annotations

import inspect

import pytest

from smalti.core import Callback, Trainer
from smalti.core.data import build_dataloader
from smalti.core.events import Events
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.plugins import hookspecs

#: The hooks the loop fires: every event hook (``on_*``) and decision hook (``should_*``) of the specs.
LOOP_HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
                    if fn.__module__ == hookspecs.__name__ and name.startswith(("on_", "should_")))


def _recording_plugin(seen: list[tuple[str, bool]], inside: list[int]) -> Callback:
    """A callback implementing every loop hook, noting each call and whether it came through ``Events``."""

    def make(name: str):
        def hook(self, state) -> None:
            seen.append((name, inside[0] > 0))

        hook.__name__ = name
        return hook

    return type("EveryHook", (Callback,), {name: make(name) for name in LOOP_HOOKS})()


class _FailsAtBatch2(MLPRegressor):
    def forward(self, batch):
        if self.training and self.calls == 1:
            raise RuntimeError("planned failure")
        self.calls += 1
        return super().forward(batch)


def test_every_loop_hook_fires_through_the_events_object(monkeypatch):
    seen: list[tuple[str, bool]] = []
    inside = [0]
    for method in ("fire", "decide"):
        original = getattr(Events, method)

        def counted(self, *args, _original=original, **kwargs):
            inside[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside[0] -= 1

        monkeypatch.setattr(Events, method, counted)

    def trainer(model, **kwargs) -> Trainer:
        return Trainer(model, build_dataloader(SyntheticRegression(32), 16), "1ep",
                       eval_dataloader=build_dataloader(SyntheticRegression(16, seed=1), 8, shuffle=False),
                       eval_interval="2ba", device_train_microbatch_size=8, loggers=[], progress_bar=False,
                       callbacks={"every": _recording_plugin(seen, inside)}, **kwargs)

    run = trainer(MLPRegressor())
    run._shrink_microbatch(next(iter(run.state.train_dataloader)))  # as after an out-of-memory error
    run.fit()
    failing = _FailsAtBatch2()
    failing.calls = 0
    with pytest.raises(RuntimeError, match="planned failure"):
        trainer(failing).fit()
    assert sorted({name for name, _ in seen}) == LOOP_HOOKS
    assert [name for name, through_events in seen if not through_events] == []
