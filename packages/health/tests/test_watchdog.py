"""The hang watchdog on 2 gloo ranks: a rank asleep in a step is found, reported with stacks, and ended."""

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from smalti.core.errors import ConfigError
from smalti.core.loggers import read_jsonl
from smalti.health.watchdog import HANG_EXIT_CODE, HangWatchdog, position, write_hang_report
from smalti.testing import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "slow_rank_run.py"


def test_a_rank_asleep_in_a_step_is_reported_and_the_run_exits_nonzero(tmp_path):
    start = time.monotonic()
    out = run_torchrun(SCRIPT, 2, ["hang", str(tmp_path)], timeout=90)
    assert out.returncode != 0
    assert time.monotonic() - start < 60  # not the 120 s the rank sleeps
    report = json.loads((tmp_path / "hang-report.json").read_text())
    assert report["stuck_ranks"] == [1]
    by_rank = {e["rank"]: e for e in report["ranks"]}
    assert set(by_rank) == {0, 1} and by_rank[1]["batch"] == 3
    # rank 1 reached no further than its forward; rank 0 went on into backward and waits there for rank 1
    assert by_rank[1]["last_event"] in ("before_forward", "after_forward")
    assert by_rank[0]["last_event"] in ("before_backward", "after_backward")
    hang_started = float((tmp_path / "hang-started").read_text())
    assert by_rank[1]["time"] - hang_started < 3 + 5  # timeout + 5 s
    assert report["stuck_hooks"] == {"1": "on_after_forward"}
    assert report["stuck_plugins"] == {"1": "hang: HangOnRank1.on_after_forward"}
    text = (tmp_path / "hang-report.txt").read_text()
    assert text.startswith("stuck rank(s): 1 (in on_after_forward, hang: HangOnRank1.on_after_forward)")
    assert "===== rank 0 stacks =====" in text and "===== rank 1 stacks =====" in text
    assert "on_after_forward" in (tmp_path / "stacks-rank1-attempt0.txt").read_text()  # the sleeping hook, by name
    assert (tmp_path / "hang-report-attempt0.txt").read_text() == text
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.stdout + out.stderr


def test_a_rank_stuck_in_a_hook_dispatched_after_the_watchdogs_is_the_one_blamed(tmp_path):
    # The watchdog's on_batch_end has counted batch 3 on rank 1 before the later callback hangs there, while
    # healthy rank 0 goes on into batch 4 and waits in its collectives: rank 0 must not look further behind.
    out = run_torchrun(SCRIPT, 2, ["hang_late", str(tmp_path)], timeout=90)
    assert out.returncode != 0
    report = json.loads((tmp_path / "hang-report.json").read_text())
    assert report["stuck_ranks"] == [1], report
    assert report["stuck_hooks"] == {"1": "on_batch_end"}
    assert report["stuck_plugins"] == {"1": "late: HangAtBatchEndOnRank1.on_batch_end"}
    by_rank = {e["rank"]: e for e in report["ranks"]}
    assert (by_rank[1]["step"], by_rank[1]["phase"]) == (3, "batch_end")
    assert by_rank[0]["step"] == 4 and by_rank[0]["hook"] != "on_batch_end"
    assert (tmp_path / "hang-report.txt").read_text().startswith("stuck rank(s): 1 (in on_batch_end, late: ")
    # before exiting, rank 0 logged that the watchdog fired and handed the report to its logger
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["metrics"]["health/watchdog/fired"] for r in metrics if "health/watchdog/fired" in r["metrics"]] == [1.0]
    assert {a["name"] for a in read_jsonl(tmp_path / "metrics.jsonl", kind="artifact")} == {
        "hang-report-attempt0.txt", "hang-report-attempt0.json"}


def _entry(rank, world, step=None, phase=None, **extra):
    entry = {"rank": rank, "world_size": world, "host": "h", "pid": 1, "batch": 7, "last_event": "before_backward",
             "seconds_without_progress": 9.0}
    if step is not None:
        entry.update(step=step, phase=phase)
    return {**entry, **extra}


def test_positions_order_a_whole_step_by_the_batch_count():
    # timestamp.batch advances after after_optimizer_step: the events before it belong to the next step
    assert position(3, "after_optimizer_step")[0] == position(4, "batch_end")[0] == 4
    order = [position(3, "batch_end"), position(3, "eval_batch_end"), position(3, "batch_checkpoint"),
             position(3, "epoch_end"), position(3, "epoch_start"), position(3, "before_dataloader"),
             position(3, "before_backward"), position(3, "after_optimizer_step"), position(4, "batch_end")]
    assert order == sorted(order) and len(set(order)) == len(order)


def test_only_the_current_restart_attempts_files_are_merged(tmp_path):
    # attempt 0 hung with rank 0 behind; attempt 1 hangs with rank 1 behind and rank 0 not reporting (yet)
    (tmp_path / "rank0-attempt0.json").write_text(json.dumps(_entry(0, 2, 2, "before_forward")))
    (tmp_path / "rank1-attempt0.json").write_text(json.dumps(_entry(1, 2, 3, "before_forward")))
    (tmp_path / "rank1-attempt1.json").write_text(json.dumps(_entry(1, 2, 5, "batch_end", hook="on_batch_end")))
    report = write_hang_report(tmp_path, attempt=1)
    assert report["restart_attempt"] == 1 and [e["rank"] for e in report["ranks"]] == [1]
    assert report["stuck_ranks"] == [0] and report["missing_ranks"] == [0]
    assert write_hang_report(tmp_path, attempt=0)["stuck_ranks"] == [0]
    assert json.loads((tmp_path / "hang-report-attempt1.json").read_text())["restart_attempt"] == 1
    # a file of another torchelastic run with the same attempt number is left out too
    (tmp_path / "rank0-attempt1.json").write_text(json.dumps(_entry(0, 2, 9, "batch_end", run_id="old")))
    assert write_hang_report(tmp_path, attempt=1, run_id="new")["missing_ranks"] == [0]
    assert write_hang_report(tmp_path, attempt=1, run_id="old")["stuck_ranks"] == [1]


def test_report_with_every_rank_at_the_same_place_blames_none(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}-attempt0.json").write_text(json.dumps(_entry(rank, 3)))
    report = write_hang_report(tmp_path, attempt=0)
    assert report["stuck_ranks"] == [2] and report["missing_ranks"] == [2]  # rank 2 never reported
    (tmp_path / "rank2-attempt0.json").write_text(json.dumps(_entry(2, 3)))
    assert write_hang_report(tmp_path, attempt=0)["stuck_ranks"] == []
    assert "suspect a collective" in (tmp_path / "hang-report.txt").read_text()


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="health.watchdog.timeout_s=0"):
        HangWatchdog(timeout_s=0)
    with pytest.raises(ConfigError, match="set_timeout: timeout_s=-1"):
        HangWatchdog().set_timeout(-1)


def test_set_timeout_applies_from_the_call_on(monkeypatch):
    # In process: the watching thread on a stand-in state, _fire recording instead of ending the process.
    fired = []
    done = threading.Event()
    watchdog = HangWatchdog(timeout_s=60, poll_s=0.02)
    monkeypatch.setattr(watchdog, "_fire", lambda idle: (fired.append((time.monotonic(), idle)), done.set()))
    state = SimpleNamespace(rank=0, world_size=1, run_name="r", timestamp=SimpleNamespace(batch=1))
    try:
        watchdog.on_fit_start(state, logger=None)
        watchdog.on_batch_end(state)
        time.sleep(0.5)  # idle under the 60 s time-out: nothing fires
        assert not fired
        called = time.monotonic()
        watchdog.set_timeout(0.3)
        # Counted from the call, not from the batch end 0.5 s ago (which would fire at the next poll).
        assert done.wait(30), "the narrowed time-out never fired"
        assert fired[0][0] - called >= 0.3 and fired[0][1] > 0.3
        assert watchdog.timeout_s == watchdog.first_batch_timeout_s == 0.3
    finally:
        watchdog.on_close()


def test_the_hang_report_reads_no_dispatch_internals():
    """The watchdog asks smalti.core.dispatch.running_hooks which hooks a hung thread is in; it names no frame
    local, code name or file of dispatch's (or pluggy's), so renaming them cannot blind the hang report."""
    import smalti.health.watchdog as watchdog

    source = Path(watchdog.__file__).read_text(encoding="utf-8")
    for internal in ("f_locals", "hook_impls", "hook_name", "dispatch.py", "_multicall", "FastHook"):
        assert internal not in source, internal
    assert "running_hooks" in source


class _HangsInAfterForward:
    """A callback that stays in ``on_after_forward`` of batch 1 until released (in-process hang)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def on_after_forward(self, state) -> None:
        if state.timestamp.batch == 1:
            self.entered.set()
            self.release.wait(60)


def _hang_in_process(callbacks, hang):
    """Train in a thread until ``hang`` holds it; yield the watchdog's view (``where``) of that thread."""
    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression

    trainer = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 8), "3ba", callbacks=callbacks,
                      loggers=[], progress_bar=False)
    worker = threading.Thread(target=trainer.fit, daemon=True)
    worker.start()
    try:
        assert hang.entered.wait(60), "the training thread never reached the hanging hook"
        return callbacks["watchdog"].where(idle=5.0)
    finally:
        hang.release.set()
        worker.join(60)


@pytest.mark.parametrize("path", ["fast", "pluggy"])
def test_the_report_names_the_hook_and_the_plugin_a_rank_hangs_in(tmp_path, path):
    """In process, on both dispatch paths: FastHook's, and pluggy's when a hook wrapper on the same hook makes
    the events object hand the call over."""
    from smalti.core import Callback
    from smalti.core.plugins import hookimpl

    class Hangs(_HangsInAfterForward, Callback):
        pass

    class Wraps(Callback):
        @hookimpl(wrapper=True, specname="on_after_forward")
        def around_after_forward(self, state):
            return (yield)

    hang = Hangs()
    watchdog = HangWatchdog(timeout_s=600, report_dir=str(tmp_path))
    callbacks = {"hang": hang, "watchdog": watchdog, **({"wraps": Wraps()} if path == "pluggy" else {})}
    where = _hang_in_process(callbacks, hang)
    assert (where["hook"], where["plugin"]) == ("on_after_forward", "hang: Hangs.on_after_forward")
    # config order is call order: "hang" is called first, after the wrapper when there is one
    assert [h["impl_index"] for h in where["in_hooks"]] == [0 if path == "fast" else 1]
    assert (where["step"], where["phase"]) == (2, "after_forward")


def _renamed_dispatch(monkeypatch):
    """smalti.core.dispatch compiled again from its source with every local name of ``FastHook.__call__``
    renamed and a different file name, then put in its place in ``sys.modules``."""
    import ast
    import builtins
    import sys
    import types

    import smalti.core.dispatch as dispatch

    tree = ast.parse(Path(dispatch.__file__).read_text(encoding="utf-8"))
    fast = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FastHook")
    call = next(n for n in fast.body if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    renamed = set()
    for node in ast.walk(call):
        if isinstance(node, ast.Name) and node.id != "self" and node.id not in vars(dispatch) \
                and node.id not in vars(builtins):
            renamed.add(node.id)
            node.id = f"renamed_{node.id}"
        elif isinstance(node, ast.arg) and node.arg != "self":
            renamed.add(node.arg)
            node.arg = f"renamed_{node.arg}"
    assert len(renamed) >= 5, renamed  # the arguments and every local variable
    module = types.ModuleType("smalti.core.dispatch")
    module.__file__ = "/elsewhere/moved_dispatch.py"
    monkeypatch.setitem(sys.modules, "smalti.core.dispatch", module)
    exec(compile(tree, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own module's source
    return module


@pytest.mark.parametrize("path", ["fast", "pluggy"])
def test_renaming_dispatch_internals_does_not_blind_the_hang_report(monkeypatch, path):
    """The report names the hook and the plugin whatever the dispatcher's local variables and file are called:
    the dispatcher records each implementation call as it makes it, nothing reads its frames."""
    import pluggy

    from smalti.core.plugins import hookimpl, hookspecs
    from smalti.health.watchdog import hooks_in_progress

    moved = _renamed_dispatch(monkeypatch)

    class Hangs(_HangsInAfterForward):
        @hookimpl
        def on_after_forward(self, state) -> None:
            super().on_after_forward(state)

    class Wraps:
        @hookimpl(wrapper=True)
        def on_after_forward(self, state):
            return (yield)

    pm = pluggy.PluginManager("smalti")
    pm.add_hookspecs(hookspecs)
    hang = Hangs()
    pm.register(hang, name="hang")
    if path == "pluggy":
        pm.register(Wraps(), name="wraps")
    hook = moved.FastHook(pm, "on_after_forward")
    worker = threading.Thread(target=lambda: hook(state=SimpleNamespace(timestamp=SimpleNamespace(batch=1)),
                                                  logger=None), daemon=True)
    worker.start()
    try:
        assert hang.entered.wait(30)
        (stuck,) = hooks_in_progress(worker.ident)
        assert stuck["hook"] == "on_after_forward" and stuck["plugin"] == "hang: Hangs.on_after_forward"
    finally:
        hang.release.set()
        worker.join(30)
