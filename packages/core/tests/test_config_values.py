"""smalti-core's value checks: its own schemas, a third-party plugin's schema, the short report and exit code 2.

The table across every package is in the repository's tests/test_config_values.py; these need smalti-core only.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from smalti.core.cli.report import MAX_LINES, format_config_error, report_config_error
from smalti.core.config.build import build
from smalti.core.config.schema import register_configs
from smalti.core.config.types import Schema, TimeStr
from smalti.core.config.validate import ConfigValueError, validate_config
from smalti.core.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "smalti-example"
QUICK = ["model=mlp", "data=synthetic", "logger=[]", "callbacks=[]"]


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize(("override", "line"), [
    ("trainer.max_duration=abc", "trainer.max_duration='abc': expected a time such as 100ba"),
    ("data.global_train_batch_size=-4", "data.global_train_batch_size=-4: expected a value > 0"),
    ("optimizer.lr=fast", "optimizer.lr='fast': expected a number"),
    ("trainer.precision=bf16", "trainer.precision='bf16': expected one of: fp32, amp_bf16, amp_fp16"),
    ("model.depth=0", "model.depth=0: expected a value > 0"),
    ("trainer.eval_interval=-3", "trainer.eval_interval=-3: expected"),
])
def test_core_value_is_named_with_what_is_expected(override, line):
    with pytest.raises(ConfigValueError) as info:
        validate_config(_compose([*QUICK, override]), world_size=1)
    assert str(info.value).startswith(line), str(info.value)


def test_defaults_and_core_options_pass():
    for overrides in ([], QUICK, ["algorithms=[ema,gradient_clipping]", "callbacks=[early_stopping,nan_guard]",
                                  "parallelism=hsdp", "optimizer=sgd", "scheduler=none", "precision=amp_bf16"]):
        validate_config(_compose(overrides), world_size=1)


def test_missing_value_is_named_by_its_key():
    cfg = _compose(QUICK)
    cfg.model.hidden = "???"
    with pytest.raises(ConfigValueError, match=r"^model.hidden: no value given"):
        validate_config(cfg)


def test_rules_of_a_schema_see_the_whole_config():
    """A schema registered by ``_target_`` checks the node wherever it is, with the full key in the report."""
    from smalti.core.config.types import ValidationInfo, model_validator, run_config
    from smalti.core.config.validate import field_error

    class Marker(Schema):
        every: TimeStr = "1ba"

        @model_validator(mode="after")
        def _not_after_the_end(self, info: ValidationInfo) -> Marker:
            if self.every == run_config(info)["trainer"]["max_duration"]:
                raise field_error("every", self.every, "shorter than trainer.max_duration")
            return self

    class Manager:
        class hook:  # noqa: N801 - what a plugin manager's ``hook`` relay looks like
            @staticmethod
            def smalti_config_schemas():
                return [{"my.Marker": Marker}]

    cfg = {"trainer": {"max_duration": "10ba"}, "callbacks": {"m": {"_target_": "my.Marker", "every": "10ba"}},
           "health": {"x": {"_target_": "my.Marker", "every": "often"}}}
    with pytest.raises(ConfigValueError) as info:
        validate_config(cfg, plugin_manager=Manager())
    assert info.value.problems == [
        "callbacks.m.every='10ba': expected shorter than trainer.max_duration",
        "health.x.every='often': expected a time such as 100ba, 2ep, 5000sp, 2e9tok or 0.1dur",
    ]


def test_report_is_short_whatever_the_message():
    long = ConfigError("\n".join(f"line {i}" for i in range(20)))
    text = format_config_error(long, "smalti-train")
    assert len(text.splitlines()) == MAX_LINES and text.startswith("smalti-train: config error: line 0")
    stream = io.StringIO()
    assert report_config_error(ConfigValueError([f"k{i}=1: expected 2" for i in range(9)]), "x", stream) == 2
    assert stream.getvalue().splitlines()[-1] == "... and 5 more"


def test_build_error_of_a_package_names_the_key_without_the_hydra_wrapping(tmp_path):
    node = _compose([*QUICK, f"+data.train.path={tmp_path / 'missing.txt'}",
                     "data.train._target_=smalti.core.examples.CharCorpus", "~data.train.num_samples",
                     "~data.train.seed"]).data.train
    with pytest.raises(ConfigError) as info:
        build(node, "data.train")
    message = str(info.value)
    assert message.startswith("data.train (smalti.core.examples.CharCorpus): data path ")
    assert "Error in call to target" not in message and "\n" not in message


def _run(module: str, args: list[str], cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_compose_error_exits_2_in_a_few_lines(tmp_path):
    out = _run("smalti.core.cli.train", [*QUICK, "data.global_train_batch_size=abc"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "smalti-train: config error: Error merging override data.global_train_batch_size=abc"
    assert "full_key: data.global_train_batch_size" in lines and len(lines) <= MAX_LINES, lines


@pytest.fixture(scope="module")
def example_plugin_path(tmp_path_factory):
    """The example third-party plugin, pip-installed into its own folder as a user would install it."""
    target = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(FIXTURE)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return target


def test_third_party_plugin_schema_checks_its_option(example_plugin_path, tmp_path):
    env = {"PYTHONPATH": str(example_plugin_path)}
    out = _run("smalti.core.cli.train", [*QUICK, "callbacks=[write_marker]", "callbacks.write_marker.path=marker.csv"],
               tmp_path, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().startswith("smalti-train: config error: callbacks.write_marker.path='marker.csv': "
                                         "expected String should match pattern"), out.stderr
    out = _run("smalti.core.cli.main", ["plugins"], tmp_path, env=env)
    assert "smalti_config_schemas" in out.stdout.split("example: ")[1].split("\n\n")[0]
