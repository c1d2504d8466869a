"""The hookspecs are documented, and the trainer calls them in the documented order."""

import inspect

import pytest

from smalti.core import Algorithm, Callback, LoggerDestination, PluginError, Trainer
from smalti.core.data import build_dataloader
from smalti.core.events import Event
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.plugins import SmaltiPluginManager, hookspecs, reset_plugin_manager
from smalti.testing.events import EventRecorder

MICRO = ["microbatch_start", "before_forward", "after_forward", "before_loss", "after_loss", "before_backward",
         "after_backward", "microbatch_end"]
EVAL = ["eval_before_all", "eval_start"] + ["eval_batch_start", "eval_before_forward", "eval_after_forward",
                                            "eval_batch_end"] * 2 + ["eval_end", "eval_after_all"]


def batch_events(micro: int, eval_after: bool) -> list[str]:
    out = ["before_dataloader", "after_dataloader", "batch_start", "before_train_batch"] + MICRO * micro
    out += ["gradients_ready", "after_train_batch", "before_optimizer_step", "after_optimizer_step", "batch_end"]
    return out + (EVAL if eval_after else []) + ["batch_checkpoint"]


def test_every_hookspec_has_a_docstring_and_keyword_signature():
    specs = [obj for name, obj in vars(hookspecs).items() if name.startswith(("on_", "should_", "smalti_", "log_"))
             or name.endswith("state_dict")]
    assert len(specs) > 40
    for spec in specs:
        assert spec.__doc__ and len(spec.__doc__.strip()) > 20, spec.__name__
        assert "state" in inspect.signature(spec).parameters or spec.__name__.startswith(("smalti_", "log_"))


def test_event_enum_matches_hookspecs():
    for event in Event:
        assert hasattr(hookspecs, event.hook_name)


def test_full_event_sequence_with_accumulation_and_eval():
    recorder = EventRecorder()
    # 32 samples, batch 16 -> 2 batches per epoch; microbatch 8 -> 2 microbatches; eval every 2 batches over 2 batches.
    trainer = Trainer(
        MLPRegressor(),
        build_dataloader(SyntheticRegression(32), 16),
        "1ep",
        eval_dataloader=build_dataloader(SyntheticRegression(16, seed=1), 8, shuffle=False),
        eval_interval="2ba",
        device_train_microbatch_size=8,
        callbacks={"recorder": recorder},
    )
    trainer.fit()
    expected = (
        ["init", "before_load", "after_load", "fit_start", "epoch_start"]
        + batch_events(2, eval_after=False)
        + batch_events(2, eval_after=True)
        + ["epoch_end", "epoch_checkpoint", "fit_end", "close"]
    )
    assert recorder.events == expected
    # The documented enum order is the order events first appear in a run (eval first fires in batch 2).
    first_seen = [e for e in dict.fromkeys(recorder.events) if not e.startswith("eval_")]
    assert first_seen == [e.value for e in Event if not e.value.startswith("eval_")]
    i = recorder.events.index("eval_before_all")
    assert recorder.events[i - 1] == "batch_end" and recorder.events[i + len(EVAL)] == "batch_checkpoint"


def test_dispatch_order_algorithms_callbacks_loggers():
    order = []

    class A(Algorithm):
        def on_batch_end(self):
            order.append("algorithm")

    class C(Callback):
        def __init__(self, tag):
            self.tag = tag

        def on_batch_end(self):
            order.append(self.tag)

    class L(LoggerDestination):
        def on_batch_end(self):
            order.append("logger")

    Trainer(
        MLPRegressor(), build_dataloader(SyntheticRegression(16), 16), "1ba",
        loggers={"l": L()}, callbacks={"c1": C("callback1"), "c2": C("callback2")}, algorithms={"a": A()},
    ).fit()
    assert order == ["algorithm", "callback1", "callback2", "logger"]


def test_misspelt_hook_fails_with_suggestion():
    class Typo(Callback):
        def on_bach_end(self, state):
            pass

    with pytest.raises(PluginError, match="on_bach_end.*did you mean 'on_batch_end'"):
        Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(16), 16), "1ba", callbacks=[Typo()])


def test_exception_fires_on_exception_then_close():
    recorder = EventRecorder()

    class Boom(Callback):
        def on_after_loss(self, state):
            raise ValueError("boom")

    trainer = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(16), 16), "1ba",
                      callbacks={"recorder": recorder, "boom": Boom()})
    with pytest.raises(ValueError, match="boom"):
        trainer.fit()
    assert recorder.events[-2:] == ["exception", "close"]
    assert not trainer.pm.is_registered(recorder)  # run plugins are unregistered after the run


def test_plugin_state_roundtrip_through_state_hooks():
    class Counter(Callback):
        def __init__(self):
            self.n = 0

        def on_batch_end(self):
            self.n += 1

        def plugin_state_dict(self):
            return {"n": self.n}

        def load_plugin_state_dict(self, plugin_state):
            self.n = plugin_state["n"]

        def on_fit_end(self, state):
            # A checkpoint plugin saves here, while the run's plugins are still registered.
            self.saved = state.state_dict()

    counter = Counter()
    t = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 16), "3ba", callbacks={"counter": counter})
    t.fit()
    saved = counter.saved
    assert saved["plugins"]["counter"] == {"n": 3}
    fresh = Counter()
    t2 = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 16), "4ba", callbacks={"counter": fresh},
                 load_state=saved)
    assert fresh.n == 3
    t2.fit()
    assert fresh.n == 4


def test_manager_honours_disable_env(monkeypatch):
    monkeypatch.setenv("SMALTI_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = SmaltiPluginManager()
    pm.load_entry_points()
    assert pm.list_name_plugin() == []


def test_broken_entry_point_names_distribution_and_escape_hatch(monkeypatch):
    import importlib.metadata as md

    class FakeDist:
        name = "smalti-broken"
        version = "0.2"

    ep = md.EntryPoint(name="broken", value="smalti_no_such_module.plugin", group="smalti")
    monkeypatch.setattr(md.EntryPoint, "dist", FakeDist(), raising=False)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep])
    reset_plugin_manager()  # entry points are scanned once per process: rescan with the broken one
    pm = SmaltiPluginManager()
    with pytest.raises(PluginError, match=r"'broken'.*smalti-broken 0.2.*SMALTI_DISABLED_PLUGINS=broken"):
        pm.load_entry_points()
    monkeypatch.setenv("SMALTI_DISABLED_PLUGINS", "broken")
    pm.load_entry_points()
    reset_plugin_manager()


def test_unclosed_trainer_plugins_do_not_leak_into_the_next_run():
    recorder = EventRecorder()
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(16), 16), "1ba", callbacks={"recorder": recorder})
    recorder.events.clear()  # the first trainer is never fitted nor closed
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(16), 16), "1ba").fit()
    assert recorder.events == []
