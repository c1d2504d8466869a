"""No credential from the config or the environment reaches the console, the run folder or a tracker."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smalti.core.redact import REDACTED, redact, redact_url

USERINFO = "cnryuser1f7"  # the user name in the tracking URI: a token is often given there
PASSWORD = "cnrypass9d2"  # the password in MLFLOW_TRACKING_URI
TAG_TOKEN = "cnrytag4b8"  # a config key naming a secret (a tag of the MLflow run)
ENV_SECRET = "cnryenv6c1"  # an environment variable the config reads into a key naming a secret
ENV_SET = "cnryset3e5"  # a secret Hydra sets in the job's environment
CANARIES = [USERINFO, PASSWORD, TAG_TOKEN, ENV_SECRET, ENV_SET]


def test_redact_urls_and_keys_naming_secrets():
    config = {
        "logger": {"mlflow": {"tracking_uri": "https://alice:s3cret@mlflow.example.com:5000/path?x=1",
                              "tags": {"team": "nlp", "API_Key": "k", "db_password": "p"}}},
        "storage": {"aws_secret_access_key": "a", "access_key_id": "b", "credentials": {"user": "u"},
                    "session_token": None, "endpoints": ["s3://bob:pw@minio:9000/bucket", "http://plain:80"]},
        "note": "see https://carol@host/x and ftp://d:e@f",
        "max_tokens": 2048, "tokenizer": "gpt2", "hf_token": "h",  # token counts and tokenizers are no secret
    }
    out = redact(config)
    assert out["logger"]["mlflow"]["tracking_uri"] == f"https://{REDACTED}@mlflow.example.com:5000/path?x=1"
    assert out["logger"]["mlflow"]["tags"] == {"team": "nlp", "API_Key": REDACTED, "db_password": REDACTED}
    assert out["storage"]["aws_secret_access_key"] == REDACTED and out["storage"]["access_key_id"] == REDACTED
    assert out["storage"]["credentials"] == REDACTED and out["storage"]["session_token"] is None
    assert out["storage"]["endpoints"] == [f"s3://{REDACTED}@minio:9000/bucket", "http://plain:80"]
    assert out["note"] == f"see https://{REDACTED}@host/x and ftp://{REDACTED}@f"
    assert out["max_tokens"] == 2048 and out["tokenizer"] == "gpt2" and out["hf_token"] == REDACTED
    assert config["logger"]["mlflow"]["tags"]["API_Key"] == "k"  # the input is left as it was
    assert redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    overrides = ["+logger.mlflow.tags.api_token=t", "optimizer.lr=0.1", "--db-password=x", "tokenizer=gpt2"]
    assert redact(overrides) == [f"+logger.mlflow.tags.api_token={REDACTED}", "optimizer.lr=0.1",
                                 f"--db-password={REDACTED}", "tokenizer=gpt2"]
    assert redact("a=1,hf_token=x,b=2") == f"a=1,hf_token={REDACTED},b=2"  # Hydra's override_dirname


def run_train(tmp_path, tracking_uri, extra=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": tracking_uri, "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "SMALTI_TEST_SERVICE_KEY": ENV_SECRET, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
           "SMALTI_RUN_NAME": "redaction"}
    args = ["model=mlp", "data=synthetic", "trainer.max_duration=4ba", "trainer.eval_interval=2ba",
            "callbacks=[progress_bar]", "callbacks.progress_bar.force=true", "logger=[console,jsonl,mlflow,wandb]",
            "logger.console.log_interval=1ba", "logger.mlflow.experiment_name=redaction",
            f"+logger.mlflow.tags.api_token={TAG_TOKEN}",
            "+logger.mlflow.tags.service_credential=${oc.env:SMALTI_TEST_SERVICE_KEY}",
            f"+hydra.job.env_set.SMALTI_DB_PASSWORD={ENV_SET}", *extra]
    return subprocess.run([sys.executable, "-m", "smalti.core.cli.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def files_with_canaries(*roots):
    found = []
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                found += [(str(path), c) for c in CANARIES if c.encode() in data]
    return found


def test_no_canary_in_any_file_or_console_output_of_a_run(tmp_path, mlflow_server):
    pytest.importorskip("wandb")
    from mlflow import MlflowClient

    host = mlflow_server.tracking_uri.removeprefix("http://")
    out = run_train(tmp_path, f"http://{USERINFO}:{PASSWORD}@{host}")
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = tmp_path / "outputs" / "redaction"
    # The run really logged everywhere (with the credentials it was given) and its files are where we look.
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("redaction").experiment_id])
    assert run.data.params["logger.mlflow.tracking_uri"] == f"http://{REDACTED}@{host}"
    assert run.data.tags["api_token"] == REDACTED and run.data.tags["service_credential"] == REDACTED
    assert float(run.data.metrics["loss/train/total"]) > 0
    wandb_runs = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(wandb_runs) == 1
    deadline = time.monotonic() + 60  # wandb's service may still be writing the offline file out
    while b"loss/train/total" not in wandb_runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        assert (run_dir / ".hydra" / name).is_file()
    assert REDACTED in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "hparams" in (run_dir / "metrics.jsonl").read_text()
    assert "loss/train/total" in out.stdout and "[config]" in out.stdout

    assert files_with_canaries(tmp_path, mlflow_server.root) == []
    console = out.stdout + out.stderr
    assert [c for c in CANARIES if c in console] == []
