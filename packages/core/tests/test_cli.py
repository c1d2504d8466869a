"""``smalti-train`` and ``smalti plugins`` as a user runs them, in subprocesses."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "smalti-example"
QUICK = ["model=mlp", "data=synthetic", "trainer.max_duration=4ba", "trainer.eval_interval=2ba", "callbacks=[]",
         "logger=[]"]


def train(args, cwd, env=None, timeout=180, module="smalti.core.cli.train"):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_runs_and_writes_output_dir(tmp_path):
    out = train(QUICK + ["optimizer.lr=3e-3"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = (tmp_path / "outputs" / "latest").resolve()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert f"finished {run_dir.name}" in (run_dir / "rank0.log").read_text()


def test_misspelt_group_option_lists_choices(tmp_path):
    out = train(QUICK + ["parallelism=fsdp2"], tmp_path)
    assert out.returncode != 0
    assert "parallelism/fsdp2" in out.stderr
    for choice in ("ddp", "fsdp", "hsdp", "single"):
        assert choice in out.stderr


def test_misspelt_key_is_named(tmp_path):
    out = train(QUICK + ["trainer.max_durration=5ba"], tmp_path)
    assert out.returncode != 0
    assert "max_durration" in out.stderr
    out = train(QUICK + ["optimizer.lrr=0.1"], tmp_path)
    assert out.returncode != 0 and "lrr" in out.stderr


def test_bad_component_argument_names_the_key(tmp_path):
    out = train(QUICK + ["+optimizer.momentumm=0.9"], tmp_path)
    assert out.returncode != 0
    assert "`optimizer`" in out.stderr and "momentumm" in out.stderr


def test_multirun_sweep(tmp_path):
    out = train(["-m", "optimizer.lr=1e-3,3e-3", *QUICK], tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    lrs = [(sweep / n / ".hydra" / "overrides.yaml").read_text() for n in ("0", "1")]
    assert "optimizer.lr=0.001" in lrs[0] and "optimizer.lr=0.003" in lrs[1]


def test_repository_conf_overrides_shipped_option(tmp_path):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "mlp.yaml").write_text("_target_: smalti.core.examples.MLPRegressor\nhidden: 3\n")
    out = train(QUICK + ["hydra.run.dir=."], tmp_path,
                env={"SMALTI_CONF_DIR": str(tmp_path / "conf")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hidden: 3" in (tmp_path / ".hydra" / "config.yaml").read_text()


def test_torchrun_ddp(tmp_path):
    from smalti.testing.torchrun import torchrun_command

    cmd = torchrun_command(2) + ["-m", "smalti.core.cli.train", *QUICK, "parallelism=ddp"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    # torchrun's run id names the run on every rank: one output folder, one log per rank.
    (run_dir,) = (p for p in (tmp_path / "outputs").iterdir() if not p.is_symlink())  # and outputs/latest
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == ["rank0.log", "rank1.log"]


@pytest.fixture(scope="module")
def example_plugin_path(tmp_path_factory):
    """The fixture package built and pip-installed into its own target folder, as a user would install it."""
    target = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(FIXTURE)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return target


def test_third_party_plugin_is_listed(example_plugin_path, tmp_path):
    env = {"PYTHONPATH": str(example_plugin_path)}
    out = train(["plugins"], tmp_path, env=env, module="smalti.core.cli.main")
    assert out.returncode == 0, out.stderr
    block = out.stdout.split("example: ")[1].split("\n\n")[0]
    assert block.startswith("smalti-example 0.3.1")
    assert "smalti_config_searchpath" in block and "pkg://smalti_example.conf" in block
    assert "core: smalti-core" in out.stdout


def test_third_party_plugin_adds_config_options_and_hooks(example_plugin_path, tmp_path):
    marker = tmp_path / "marker.txt"
    env = {"PYTHONPATH": str(example_plugin_path), "EXAMPLE_MARKER": str(marker)}
    out = train(["model=wide_mlp", "data=synthetic", "trainer.max_duration=3ba", "callbacks=[write_marker]",
                 "logger=[]"], tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    batches, loss = marker.read_text().split()
    assert batches == "3" and float(loss) > 0


def test_disabled_plugin_is_skipped(example_plugin_path, tmp_path):
    env = {"PYTHONPATH": str(example_plugin_path), "SMALTI_DISABLED_PLUGINS": "smalti-example"}
    out = train(["plugins"], tmp_path, env=env, module="smalti.core.cli.main")
    assert out.returncode == 0 and "example:" not in out.stdout


def test_default_run_with_loggers_and_callbacks(tmp_path):
    """The default loggers and callbacks on the shipped model and corpus: console output and metrics.jsonl."""
    out = train(["optimizer.lr=3e-3", "trainer.max_duration=40ba", "trainer.eval_interval=20ba"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (last,) = [line for line in out.stdout.splitlines() if line.startswith("[batch 40 40/40ba]")]
    assert "loss/train/total" in last
    from smalti.core.loggers import read_jsonl

    rows = read_jsonl(tmp_path / "outputs" / "latest" / "metrics.jsonl")
    losses = [r["metrics"]["loss/train/total"] for r in rows if "loss/train/total" in r["metrics"]]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert any("throughput/tokens_per_sec" in r["metrics"] for r in rows)
    assert [r["step"] for r in rows if "metrics/eval/CrossEntropy" in r["metrics"]] == [20, 40]


def test_auto_microbatching_from_the_command_line(tmp_path):
    out = train(QUICK + ["trainer.device_train_microbatch_size=auto"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]



RUN_AND_COUNT_WRAPPED_MODELS = """
import gc, os
from hydra import compose, initialize_config_module
import smalti.core.cli.train  # registers the config schemas
from smalti.core.config.build import run
from torch.nn.parallel import DistributedDataParallel
with initialize_config_module(version_base="1.3", config_module="smalti.core.conf"):
    cfg = compose("train", overrides=["parallelism=ddp", "model=mlp", "data=synthetic", "trainer.max_duration=2ba",
                                      "trainer.eval_interval=null", "callbacks=[]", "logger=[]"])
run(cfg)
alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
print(f"rank {os.environ['RANK']}: {alive} DDP models alive after run", flush=True)
"""


def test_run_frees_the_wrapped_model_before_the_process_exits(tmp_path):
    # The DDP model holds the process group; left in reference cycles for the collector at interpreter exit, it
    # took gloo's threads down mid-finalization and the rank aborted ("terminate called without an active
    # exception", ~1 two-rank run in 20).
    from smalti.testing.torchrun import torchrun_command

    script = tmp_path / "run_and_count.py"
    script.write_text(RUN_AND_COUNT_WRAPPED_MODELS)
    out = subprocess.run(torchrun_command(2) + [str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert sorted(re.findall(r"rank (\d): (\d+) DDP models alive", out.stdout)) == [("0", "0"), ("1", "0")], out.stdout


def test_every_file_of_a_run_goes_under_hydra_run_dir(tmp_path):
    """What sweeps and schedulers set: with ``hydra.run.dir=X`` nothing of the run lands anywhere but ``X``."""
    out = train(["model=mlp", "data=synthetic", "trainer.max_duration=4ba", "trainer.eval_interval=2ba",
                 "callbacks=[profiler,goodput]", "callbacks.profiler.wait=0", "callbacks.profiler.warmup=0",
                 "callbacks.profiler.active=1", "logger=[jsonl]", "hydra.run.dir=jobs/42"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "jobs" / "42"
    for name in ("metrics.jsonl", "rank0.log", "goodput.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "traces").glob("rank0.step*.trace.json"))
    outside = [p.relative_to(tmp_path) for p in tmp_path.rglob("*")
               if p.is_file() and run not in p.parents and not p.is_symlink()]
    assert outside == [], f"files of the run outside hydra.run.dir: {outside}"
    assert (tmp_path / "outputs" / "latest").resolve() == run.resolve()


def test_too_few_rows_for_a_batch_is_one_line_with_the_numbers_before_the_model(tmp_path):
    out = train(QUICK + ["data.global_train_batch_size=2048", "model._target_=no.such.Model"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("smalti-train: config error: data.train has no full batch: 1024 rows")
    assert "data.global_train_batch_size=2048 over 1 data-parallel rank(s)" in lines[0]
    assert "at most 1024" in lines[0]  # what to change; and the (unbuildable) model was never reached


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_any_error_while_building_is_one_line_and_the_traceback_on_request(tmp_path):
    out = train(QUICK + ["trainer.device=cuda"], tmp_path)
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("smalti-train: error: building the trainer"), line
    assert "Torch not compiled with CUDA enabled" in line and "HYDRA_FULL_ERROR=1" in line
    full = train(QUICK + ["trainer.device=cuda"], tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr and "BuildError" in full.stderr
