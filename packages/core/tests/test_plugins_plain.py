"""Plugins written the plain way: the README's entry-point recipe without decorators, one manager per Trainer,
and a bad option inside a list-valued group listing the valid choices."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.examples import MLPRegressor
from smalti.core.plugins import new_plugin_manager

FIXTURE = Path(__file__).parent / "fixtures" / "smalti-plain"


def run(module, args, cwd, env=None, timeout=240):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plain_plugin_path(tmp_path_factory):
    """The fixture package pip-installed into its own folder, as a user would install it."""
    target = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(FIXTURE)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return target


def test_readme_recipe_without_decorators_is_listed_and_runs(plain_plugin_path, tmp_path):
    env = {"PYTHONPATH": str(plain_plugin_path), "SMALTI_DISABLED_PLUGINS": "plain_typo"}
    out = run("smalti.core.cli.main", ["plugins"], tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    block = out.stdout.split("plain: ")[1].split("\nplain_typo")[0]
    assert "hooks: on_fit_end, smalti_config_searchpath\n" in block, block
    marker = tmp_path / "marker.txt"
    out = run("smalti.core.cli.train", ["model=mlp", "data=synthetic", "trainer.max_duration=3ba", "logger=[]",
                                        "callbacks=[plain_noop]"], tmp_path, env={**env, "PLAIN_MARKER": str(marker)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.read_text().strip() == "3"


def test_misspelt_plain_hook_fails_naming_it_and_the_closest_hook(plain_plugin_path, tmp_path):
    env = {"PYTHONPATH": str(plain_plugin_path), "SMALTI_PLUGINS": "plain_typo"}
    out = run("smalti.core.cli.main", ["plugins"], tmp_path, env=env)
    assert out.returncode != 0
    assert "'on_fit_ned'" in out.stderr and "did you mean 'on_fit_end'" in out.stderr
    assert "plain_typo" in out.stderr


def test_bad_option_inside_a_list_lists_the_choices(tmp_path):
    out = run("smalti.core.cli.train", ["model=mlp", "data=synthetic", "callbacks=[speed_monitor,typo]"], tmp_path)
    assert out.returncode != 0
    assert "'typo' is not an option of group 'callbacks'" in out.stderr
    listed = out.stderr.split("Available options in 'callbacks':")[1].split("Config search path:")[0].split()
    assert {"speed_monitor", "lr_monitor", "progress_bar", "early_stopping"} <= set(listed)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_batch_end(self, state):
        self.events.append(state.timestamp.batch)


def _trainer(callback, batches):
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(batches)]
    return Trainer(model=MLPRegressor(8, 4, out_features=1), train_dataloader=data, max_duration=f"{batches}ba",
                   eval_interval=None, callbacks={"recorder": callback}, loggers={}, run_name=None)


def test_two_trainers_in_one_process_never_see_each_others_plugins():
    first, second = Recorder(), Recorder()
    a = _trainer(first, 2)
    b = _trainer(second, 3)
    assert a.pm is not b.pm
    assert a.state.run_name != b.state.run_name
    b.fit()
    assert first.events == [] and second.events == [1, 2, 3]
    a.fit()  # the first trainer still has its own plugins after the second one ran
    assert first.events == [1, 2] and second.events == [1, 2, 3]
    assert not a.pm.is_registered(second) and not b.pm.is_registered(first)


def test_each_manager_gets_the_installed_plugins():
    one, two = new_plugin_manager(), new_plugin_manager()
    assert one is not two and one.get_plugin("core") is two.get_plugin("core") is not None


def test_plugins_run_lists_what_a_run_will_have(tmp_path):
    out = run("smalti.core.cli.main", ["plugins", "--run", "callbacks=[speed_monitor,lr_monitor]", "logger=[jsonl]",
                                       "callbacks.lr_monitor=null"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    callbacks = out.stdout.split("callbacks:\n")[1].split("logger:")[0]
    assert "speed_monitor: smalti.core.callbacks.SpeedMonitor" in callbacks and "lr_monitor" not in callbacks
    assert "jsonl: smalti.core.loggers.JSONLLogger" in out.stdout.split("logger:\n")[1]
    assert "checkpoint: -" in out.stdout
