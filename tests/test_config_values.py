"""Bad config values across every package fail before anything is built: a few lines, the key, the expectation.

Issue 18 part 1. The table is checked in-process against what ``smalti-train`` does with a composed config
(the same validation and the same report); a few rows also go through ``smalti-train`` in-process and as a
real subprocess, for the exit code and the absence of a traceback.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from smalti.core.cli.report import CONFIG_ERROR_EXIT, MAX_LINES, format_config_error, report_config_error
from smalti.core.config.schema import register_configs
from smalti.core.config.validate import validate_config
from smalti.core.errors import ConfigError
from smalti.testing.train_cli import smalti_train_in_process

MISSING = "/nonexistent/smalti-h18"

# (package, overrides, full key named, expectation named)
TABLE = [
    ("core", ["trainer.max_duration=abc"], "trainer.max_duration='abc'", "a time such as 100ba"),
    ("core", ["trainer.max_duration=0.5dur"], "trainer.max_duration", "ep, ba, sp or tok"),
    ("core", ["trainer.eval_interval=soon"], "trainer.eval_interval='soon'", "a time such as"),
    ("core", ["data.global_train_batch_size=-4"], "data.global_train_batch_size=-4", "a value > 0"),
    ("core", ["data.eval_batch_size=0"], "data.eval_batch_size=0", "a value > 0"),
    ("core", ["optimizer.lr=fast"], "optimizer.lr='fast'", "a number"),
    ("core", ["optimizer.betas=[0.9,1.5]"], "optimizer.betas[1]=1.5", "a value < 1"),
    ("core", ["trainer.precision=fp8"], "trainer.precision='fp8'", "one of: fp32, amp_bf16, amp_fp16"),
    ("core", ["trainer.device_train_microbatch_size=0"], "trainer.device_train_microbatch_size=0", "auto"),
    ("core", ["trainer.device=gpu"], "trainer.device='gpu'", "cpu, cuda or cuda:1"),
    ("core", ["scheduler.alpha_f=2"], "scheduler.alpha_f=2", "a value <= 1"),
    ("core", ["model=mlp", "data=synthetic", "model.dropout=1.5"], "model.dropout=1.5", "a value < 1"),
    ("core", ["algorithms=[gradient_clipping]", "algorithms.gradient_clipping.clipping_type=l3"],
     "algorithms.gradient_clipping.clipping_type='l3'", "one of: norm, value"),
    ("core", ["callbacks=[early_stopping]", "callbacks.early_stopping.mode=lowest"],
     "callbacks.early_stopping.mode='lowest'", "one of: min, max"),
    ("core", ["callbacks=[loss_spike]", "callbacks.loss_spike.window_size=many"],
     "callbacks.loss_spike.window_size='many'", "expected an integer"),
    ("core", ["callbacks=[activation_monitor]", "callbacks.activation_monitor.stats=[max,median]"],
     "callbacks.activation_monitor.stats[1]='median'", "one of: max, average, std, l2_norm, kurtosis"),
    ("core", ["algorithms=[seq_length_warmup]", "algorithms.seq_length_warmup.min_seq_length=2048"],
     "algorithms.seq_length_warmup.min_seq_length=2048", "at most max_seq_length"),
    ("core", ["algorithms=[layer_freezing]", "algorithms.layer_freezing.freeze_start=later"],
     "algorithms.layer_freezing.freeze_start='later'", "a time such as"),
    ("core", ["algorithms=[swa]", "algorithms.swa.anneal_strategy=step"],
     "algorithms.swa.anneal_strategy='step'", "one of: cos, linear"),
    ("core", ["algorithms=[sam]", "algorithms.sam.rho=0"], "algorithms.sam.rho=0", "a value > 0"),
    ("core", ["parallelism=fsdp", "parallelism.param_dtype=bf16"], "parallelism.param_dtype='bf16'",
     "one of: float32, bfloat16, float16"),
    ("core", ["model.n_heads=3"], "model.n_heads=3", "a divisor of model.d_model=128"),
    ("streaming", ["data=streaming", "data.train.local=TMP", "data.train.shuffle_algo=py9"],
     "data.train.shuffle_algo='py9'", "one of: naive, py1s, py2s, py1br, py1e"),
    ("streaming", ["data=streaming", f"data.train.local={MISSING}"], "data.train.local", "an existing folder"),
    ("streaming", ["data=streaming", "data.train.local=TMP", "data.train.cache_limit=lots"],
     "data.train.cache_limit='lots'", "a size such as 50gb"),
    ("streaming", ["data=streaming", "data.train.local=TMP", "data.train.partition_algo=fast"],
     "data.train.partition_algo='fast'", "one of: orig, relaxed"),
    ("streaming", ["data=streaming", "data.train.local=TMP", "data.train.download_timeout=0"],
     "data.train.download_timeout=0", "a value > 0"),
    ("checkpoint", ["checkpoint=dcp", "checkpoint.save_interval=often"], "checkpoint.save_interval='often'",
     "a time such as"),
    ("checkpoint", ["checkpoint=dcp", "checkpoint.verify=sha1"], "checkpoint.verify='sha1'",
     "one of: none, manifest, full"),
    ("checkpoint", ["checkpoint=dcp", f"checkpoint.load_path={MISSING}"], "checkpoint.load_path",
     "an existing file or folder"),
    ("checkpoint", ["checkpoint=dcp", "checkpoint.thread_count=0"], "checkpoint.thread_count=0", "a value > 0"),
    ("checkpoint", ["checkpoint=dcp", "checkpoint.save_on_signal=[SIGFOO]"], "checkpoint.save_on_signal[0]",
     "signal names"),
    ("health", ["health=[watchdog]", "health.watchdog.timeout_s=0"], "health.watchdog.timeout_s=0", "a value > 0"),
    ("health", ["health=[mfu_alarm]", "health.mfu_alarm.min_mfu=1.5"], "health.mfu_alarm.min_mfu=1.5",
     "a value <= 1"),
    ("health", ["health=[mfu_alarm]", "health.mfu_alarm.action=panic"], "health.mfu_alarm.action='panic'",
     "one of: warn, stop"),
    ("health", ["health=[straggler]", "health.straggler.factor=0.5"], "health.straggler.factor=0.5", "a value > 1"),
    ("llm", ["model=gpt_tiny", "data=markov", "model.norm_type=batchnorm"], "model.norm_type='batchnorm'",
     "one of: layernorm, rmsnorm, low_precision_layernorm, low_precision_rmsnorm"),
    ("llm", ["model=gpt_tiny", "data=markov", "model.position=sinusoidal"], "model.position='sinusoidal'",
     "one of: alibi, rope, learned, none"),
    ("llm", ["model=llama_tiny", "data=markov", "model.n_kv_heads=3"], "model.n_kv_heads=3",
     "a divisor of model.n_heads=4"),
    ("llm", ["model=gpt_tiny", "data=markov", "parallelism=fsdp_sp", "parallelism.sp=3"], "model.n_heads=4",
     "a multiple of parallelism.sp=3"),
    ("llm", ["experiment=finetune_hf"], "model.pretrained", "no value given"),
    ("llm", ["experiment=finetune_hf", f"model.pretrained={MISSING}"], "model.pretrained",
     "an existing file or folder"),
    ("moe", ["model=moe_tiny", "data=markov", "model.moe.top_k=9"], "model.moe.top_k=9", "at most num_experts=8"),
    ("moe", ["model=moe_tiny", "data=markov", "model.moe.loss_weight=-1"], "model.moe.loss_weight=-1",
     "a value >= 0"),
    ("moe", ["model=moe_tiny", "data=markov", "+model.moe.score_func=relu"], "model.moe.score_func='relu'",
     "one of: softmax, sigmoid"),
    ("moe", ["callbacks=[moe_bias_update]", "callbacks.moe_bias_update.coeff=0"], "callbacks.moe_bias_update.coeff=0",
     "a value > 0"),
]


@pytest.fixture
def composer():
    register_configs()

    def compose_run(overrides: list[str]):
        with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
            return compose("train", overrides=overrides)

    return compose_run


def _overrides(overrides: list[str], tmp_path) -> list[str]:
    return [o.replace("TMP", str(tmp_path)) for o in overrides]


@pytest.mark.parametrize(("package", "overrides", "key", "expected"), TABLE,
                         ids=[f"{row[0]}:{row[1][-1]}" for row in TABLE])
def test_bad_value_is_named_in_a_few_lines(composer, tmp_path, package, overrides, key, expected):
    cfg = composer(_overrides(overrides, tmp_path))
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=1)
    stream = io.StringIO()
    assert report_config_error(info.value, "smalti-train", stream) == CONFIG_ERROR_EXIT
    text = stream.getvalue()
    assert len(text.splitlines()) <= MAX_LINES, text
    assert key in text and expected in text, text
    assert "Traceback" not in text


def test_table_spans_every_package_with_enough_rows():
    assert len(TABLE) >= 25
    assert {row[0] for row in TABLE} == {"core", "streaming", "checkpoint", "health", "llm", "moe"}


def test_global_batch_must_divide_over_the_data_parallel_ranks(composer):
    cfg = composer(["data.global_train_batch_size=30"])
    with pytest.raises(ConfigError, match=r"data.global_train_batch_size=30: expected a multiple of the 4 "):
        validate_config(cfg, world_size=4)
    # Sequence parallelism: 8 ranks in groups of sp=2 are 4 data-parallel ranks.
    cfg = composer(["model=gpt_tiny", "data=markov", "parallelism=fsdp_sp", "data.global_train_batch_size=12",
                    "data.eval_batch_size=12"])
    validate_config(cfg, world_size=8)
    cfg = composer(["model=gpt_tiny", "data=markov", "parallelism=fsdp_sp", "data.global_train_batch_size=6",
                    "data.eval_batch_size=12"])
    with pytest.raises(ConfigError, match="the 4 data-parallel ranks"):
        validate_config(cfg, world_size=8)


def test_every_problem_is_listed_in_at_most_five_lines(composer):
    cfg = composer(["model=mlp", "data=synthetic", "trainer.precision=fp8", "trainer.seed=-1", "optimizer.lr=-1",
                    "scheduler.alpha_f=2", "trainer.max_duration=abc", "model.depth=0"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=1)
    text = format_config_error(info.value, "smalti-train")
    assert len(text.splitlines()) == 5 and text.endswith("... and 2 more"), text


SHIPPED = [
    [], ["model=mlp", "data=synthetic"], ["model=llama_tiny", "data=markov"],
    ["model=moe_tiny", "data=markov", "callbacks=[moe_bias_update,early_stopping,memory_monitor,nan_guard]"],
    ["algorithms=[ema,gradient_clipping]", "health=[watchdog,straggler,mfu_alarm,gpu_monitor]", "checkpoint=dcp"],
    ["checkpoint=s3", "parallelism=hsdp", "optimizer=sgd", "scheduler=linear_with_warmup",
     "logger=[console,jsonl,mlflow,wandb]"],
    ["parallelism=fsdp_sp", "model=gpt_tiny", "data=markov"],
    ["parallelism=fsdp_bf16", "optimizer=decoupled_adamw", "scheduler=inverse_sqrt_with_warmup",
     "precision=amp_bf16"],
    ["parallelism=ddp", "precision=amp_fp16", "scheduler=constant_with_warmup"],
    ["data=streaming", "data.train.local=TMP"], ["model=gpt_tiny", "data=finetune_tiny"],
    ["model=gpt_tiny", "data=text_mds"], ["callbacks=[hf_export,icl,mlflow_model]", "model=gpt_tiny"],
    *[[f"experiment={name}"] for name in ("finetune_tiny", "gpt_tiny", "llama3_8b", "moe_dbrx_like", "moe_tiny",
                                          "mpt_125m", "mpt_1b", "mpt_350m", "mpt_7b")],
    ["experiment=finetune_hf", "model.pretrained=TMP"],
]


@pytest.mark.parametrize("overrides", SHIPPED, ids=[" ".join(o) or "defaults" for o in SHIPPED])
def test_shipped_options_and_experiments_pass(composer, tmp_path, overrides):
    validate_config(composer(_overrides(overrides, tmp_path)), world_size=1)


@pytest.mark.parametrize(("overrides", "key", "expected"), [
    (["trainer.max_duration=abc"], "trainer.max_duration", "a time"),
    (["model=moe_tiny", "data=markov", "model.moe.top_k=9"], "model.moe.top_k", "at most num_experts=8"),
    (["health=[watchdog]", "health.watchdog.poll_s=-1"], "health.watchdog.poll_s", "a value > 0"),
    (["data.global_train_batch_size=abc"], "data.global_train_batch_size", "converted to Integer"),
])
def test_smalti_train_in_process_exits_2_without_traceback(tmp_path, monkeypatch, overrides, key, expected):
    code, err = smalti_train_in_process(overrides, tmp_path, monkeypatch)
    assert code == 2, err
    assert err.startswith("smalti-train: config error: ") and "Traceback" not in err, err
    assert len(err.splitlines()) <= MAX_LINES and key in err and expected in err, err


def test_unexpected_exception_keeps_its_traceback(tmp_path, monkeypatch):
    from smalti.core.config import build

    def broken(cfg):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(build, "run", broken)
    code, err = smalti_train_in_process(["model=mlp", "data=synthetic"], tmp_path, monkeypatch)
    assert code == 1
    assert "Traceback" in err and "RuntimeError: a real bug" in err, err


def test_build_time_error_of_a_package_has_the_same_form(tmp_path, monkeypatch):
    """A missing data folder found while building (smalti-llm's own check): short, named by key, exit 2."""
    code, err = smalti_train_in_process(["model=gpt_tiny", "data=text_mds", f"data.train.local={MISSING}",
                                         "logger=[]", "callbacks=[]"], tmp_path, monkeypatch)
    assert code == 2, err
    assert err.startswith("smalti-train: config error: data.train (smalti.llm.data.prepare.PreparedTextMDS): "), err
    assert MISSING in err and "Traceback" not in err and len(err.splitlines()) <= MAX_LINES, err


def test_smalti_plugins_run_checks_values_too(capsys):
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.cli.main import main

    GlobalHydra.instance().clear()
    assert main(["plugins", "--run", "experiment=gpt_tiny", "model.n_heads=5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "smalti plugins --run: config error: model.n_heads=5: expected a divisor of model.d_model=128"


def _cli(args: list[str], cwd, module: str = "smalti.core.cli.train", env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_smalti_train_cli_reports_a_bad_value_in_one_line_with_exit_2(tmp_path):
    out = _cli(["model=mlp", "data=synthetic", "optimizer.lr=fast"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == "smalti-train: config error: optimizer.lr='fast': expected a number", out.stderr
