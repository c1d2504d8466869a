"""Run names and output folders: runs never collide, ranks agree (with checkpoints: tests/test_run_names_with_checkpoints.py)."""

import os
import re
import subprocess

import pytest

from smalti.core.errors import ConfigError
from smalti.core.run_name import check_run_name, generate_run_name, is_generated, stable_name_from_env
from smalti.testing.train_cli import smalti_train as train

QUICK = ["model=mlp", "data=synthetic", "trainer.max_duration=3ba", "trainer.eval_interval=100ba", "callbacks=[]",
         "logger=[jsonl]"]
GENERATED = re.compile(r"^\d{8}-\d{6}-[a-z]+-[a-z]+$")


def losses(path):
    from smalti.core.loggers import read_jsonl

    return [r["metrics"]["loss/train/total"] for r in read_jsonl(path) if "loss/train/total" in r["metrics"]]


def test_two_runs_in_a_row_get_their_own_folders_and_latest_points_at_the_second(tmp_path):
    first = train(QUICK, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(QUICK + ["trainer.max_duration=2ba"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "outputs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and all(GENERATED.match(p.name) for p in runs), runs
    # each run's metrics file holds that run's batches only
    assert sorted(len(losses(p / "metrics.jsonl")) for p in runs) == [2, 3]
    latest = tmp_path / "outputs" / "latest"
    assert latest.is_symlink() and len(losses(latest / "metrics.jsonl")) == 2
    assert f"finished {latest.resolve().name}" in (latest / "rank0.log").read_text()


def test_torchrun_ranks_agree_on_the_generated_name(tmp_path):
    from smalti.testing.torchrun import torchrun_command

    cmd = torchrun_command(2) + ["-m", "smalti.core.cli.train", *QUICK, "parallelism=ddp"]
    env = {k: v for k, v in os.environ.items() if k not in ("SMALTI_RUN_NAME", "SLURM_JOB_ID")}
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (run_dir,) = (p for p in (tmp_path / "outputs").iterdir() if not p.is_symlink())
    assert GENERATED.match(run_dir.name), run_dir.name
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert f"finished {run_dir.name} " in (run_dir / "rank0.log").read_text()


@pytest.mark.parametrize(("env", "expected"), [
    ({"SMALTI_RUN_NAME": "mine", "TORCHELASTIC_RUN_ID": "job7"}, "mine"),
    ({"TORCHELASTIC_RUN_ID": "job7", "SLURM_JOB_ID": "42"}, "job7"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}, "slurm-42"),
    ({"TORCHELASTIC_RUN_ID": "3f2b8c1e-5d4a-4c3b-9e8f-0a1b2c3d4e5f"}, None),  # torchrun --standalone: random
    ({}, None),
])
def test_stable_names_come_from_the_user_or_launcher(env, expected):
    assert stable_name_from_env(env) == expected


def test_generated_names_are_readable_and_not_stable():
    names = {generate_run_name() for _ in range(20)}
    assert len(names) > 1 and all(GENERATED.match(n) and is_generated(n) for n in names)


@pytest.mark.parametrize("bad", ["../../../escaped", "a/b", "/abs", ".hidden", "-flag", "x" * 201, "a b", "a\nb"])
def test_a_run_name_from_the_environment_is_one_safe_folder_name(bad):
    with pytest.raises(ConfigError, match=r"\$SMALTI_RUN_NAME=.*not a valid run name"):
        stable_name_from_env({"SMALTI_RUN_NAME": bad})
    with pytest.raises(ConfigError, match=r"\$TORCHELASTIC_RUN_ID"):
        stable_name_from_env({"TORCHELASTIC_RUN_ID": bad})
    assert check_run_name("llama3-8b_sft.v2+lr=3e-4", "run_name") == "llama3-8b_sft.v2+lr=3e-4"


def test_an_escaping_run_name_stops_the_run_before_any_folder_is_made(tmp_path):
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    out = train(QUICK, work, env={"SMALTI_RUN_NAME": "../../../escaped"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "smalti-train: config error: $SMALTI_RUN_NAME='../../../escaped' is not a valid run name: it must be one "
        "folder name of at most 200 letters, digits and '._-+=@,', not starting with '.' or '-' (it names the run's "
        "output and checkpoint folders)"]
    out = train([*QUICK, "run_name=../up"], work)
    assert out.returncode == 2 and "run_name='../up' is not a valid run name" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "escaped").exists() and not (work / "up").exists() and not (work / "outputs").exists()


def test_the_python_api_holds_run_names_to_one_folder_name_too(tmp_path, monkeypatch):
    """``Trainer(...)`` without Hydra: the environment's name and a given one are checked before any folder."""
    import torch

    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.core.examples import MLPRegressor, SyntheticRegression

    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    loader = build_dataloader(SyntheticRegression(16), 8, seed=0)
    monkeypatch.setenv("SMALTI_RUN_NAME", "../../escaped")
    with pytest.raises(ConfigError, match=r"\$SMALTI_RUN_NAME='../../escaped' is not a valid run name"):
        Trainer(MLPRegressor(), loader, "1ba", optimizers=lambda p: torch.optim.SGD(p, lr=0.1))
    monkeypatch.delenv("SMALTI_RUN_NAME")
    with pytest.raises(ConfigError, match=r"Trainer\(run_name=\.\.\.\)='a/../../b' is not a valid run name"):
        Trainer(MLPRegressor(), loader, "1ba", optimizers=lambda p: torch.optim.SGD(p, lr=0.1), run_name="a/../../b")
    assert not (tmp_path / "escaped").exists() and not (work / "outputs").exists()
