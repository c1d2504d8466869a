"""No credential from the config or the environment reaches the console, the run folder or a tracker."""

import os
import subprocess
import sys
import time
from pathlib import Path

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
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": tracking_uri, "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "SMALTI_TEST_SERVICE_KEY": ENV_SECRET, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
           "SMALTI_RUN_NAME": "redaction"}
    args = ["model=mlp", "data=synthetic", "trainer.max_duration=4ba", "trainer.eval_interval=2ba",
            "callbacks=[progress_bar]", "callbacks.progress_bar.force=true", "logger=[console,jsonl,mlflow,wandb]",
            "logger.console.log_interval=1ba", "logger.mlflow.experiment_name=redaction",
            f"+logger.mlflow.tags.api_token={TAG_TOKEN}",
            "+logger.mlflow.tags.service_credential=${oc.env:SMALTI_TEST_SERVICE_KEY}",
            f"+hydra.job.env_set.SMALTI_DB_PASSWORD={ENV_SET}", *extra]
    flags = [a for a in args if a == "-m"]  # Hydra's flags come before the overrides
    args = [a for a in args if a != "-m"]
    return subprocess.run([sys.executable, "-m", "smalti.core.cli.train", *flags, *args], cwd=tmp_path, env=env,
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


def test_more_secret_keys_values_and_bytes():
    for key in ("auth", "Authorization", "db_pwd", "x.pass", "passphrase", "cookie", "session", "SESSION_ID",
                "bearer", "signature", "sas", "sas_url", "sentry_dsn", "connection_string", "webhook_url",
                "slack_webhook-url", "stripe_key", "+x.db_password"):
        assert redact({key: "v"}) == {key: REDACTED}, key
    for key in ("passes", "compass", "bypass", "prompt_key", "text_key", "max_tokens", "tokenizer", "full_key"):
        assert redact({key: "v"}) == {key: "v"}, key
    # a password holding '@' is taken whole; a secret query parameter after another one too
    assert redact_url("https://user:p@ss@host/x") == f"https://{REDACTED}@host/x"
    assert redact("see https://h/x?a=1&password=pw9&b=2") == f"see https://h/x?a=1&password={REDACTED}&b=2"
    assert redact(b"uri https://u:pw@h and api_key=k1") == f"uri https://{REDACTED}@h and api_key={REDACTED}".encode()
    assert redact('{"db_password": "abc123", "n": 1}') == f'{{"db_password": "{REDACTED}", "n": 1}}'
    assert redact("Timestamp(batch=2, token=512)") == "Timestamp(batch=2, token=512)"  # counts are no secret


def test_quoted_values_http_credentials_and_flags_are_redacted():
    """Hydra's quoted overrides, Authorization headers, ``--password value`` and SAS ``sig=`` keep no secret."""
    assert redact("#0 : +x.db_password='p w1' lr=1") == f"#0 : +x.db_password='{REDACTED}' lr=1"
    assert redact('db_password="pw2" token: \'a b\'') == f'db_password="{REDACTED}" token: \'{REDACTED}\''
    assert redact("curl -H 'Authorization: Bearer tk3' x") == f"curl -H 'Authorization: {REDACTED}' x"
    assert redact("{'Authorization': 'Basic dXM6cHc='}") == f"{{'Authorization': '{REDACTED}'}}"
    assert redact("sent bearer tk4abcdef to h") == f"sent bearer {REDACTED} to h"
    assert redact("Cannot convert 'dict' to string: '{'api_key': 'k9'}'") == \
        f"Cannot convert 'dict' to string: '{{'api_key': '{REDACTED}'}}'"
    assert redact("app --password pw5 --api-key 'k 6' --max-restarts 3") == \
        f"app --password {REDACTED} --api-key '{REDACTED}' --max-restarts 3"
    assert redact("api_key = k7") == f"api_key = {REDACTED}"
    assert redact("https://acct.blob.core.windows.net/c/o?sv=2022&sig=abcDEF%3D") == \
        f"https://acct.blob.core.windows.net/c/o?sv=2022&sig={REDACTED}"
    assert redact("+x.url='https://h/?a=1&password=pw8'") == f"+x.url='https://h/?a=1&password={REDACTED}'"
    for prose in ("tokenizer: gpt2, x = 1, --nnodes 2", "see .../override_grammar/basic for details", "bearer of news"):
        assert redact(prose) == prose


def test_remembered_secrets_and_log_records_are_redacted(caplog):
    import logging

    from smalti.core.redact import install_log_redaction, redact_text, remember_secrets

    remember_secrets({"db": {"pass": "cnryrem1a"}, "overrides": ["+x.sas=cnryrem2b"], "n": {"api_key": 12345678}})
    assert redact_text("bad value 'cnryrem1a' for x; cnryrem2b; 12345678") == f"bad value '{REDACTED}' for x; " \
        f"{REDACTED}; {REDACTED}"
    install_log_redaction()
    with caplog.at_level(logging.INFO):
        logging.getLogger("hydra.some.launcher").info("\t#0 : %s", "+db.auth=cnryrem3c lr=0.1 cnryrem1a")
    assert caplog.records[-1].getMessage() == f"\t#0 : +db.auth={REDACTED} lr=0.1 {REDACTED}"


WITH_AT = "cnryat7a1"  # the tail of a URL password that holds '@'
QUERY_PW = "cnryqry2b"  # password= after another query parameter
DB_PWD = "cnrypwd5c"  # a key the old rule did not count as secret
BAD_VALUE = "cnrybad8d"  # quoted back by a config error
QUOTED = "cnryquo3e"  # a secret override quoted by the user, as Hydra's grammar allows
MORE = [WITH_AT, QUERY_PW, DB_PWD, BAD_VALUE, QUOTED]


def secret_overrides():
    return ["+logger.mlflow.tags.db_pwd=" + DB_PWD, f"+logger.mlflow.tags.db_password='{QUOTED} x'",
            f"+logger.mlflow.tags.endpoint='https://svc:pa@{WITH_AT}@host/x?a=1&password={QUERY_PW}'"]


def no_canary_anywhere(out, *roots):
    console = out.stdout + out.stderr
    assert [c for c in CANARIES + MORE if c in console] == [], console[-3000:]
    assert files_with_canaries(*roots) == []
    for root in roots:
        assert [p for p in Path(root).rglob("*") if p.is_file() and any(c.encode() in p.read_bytes() for c in MORE)] == []


def test_sweeps_failures_and_config_errors_print_and_save_no_canary(tmp_path, mlflow_server):
    host = mlflow_server.tracking_uri.removeprefix("http://")
    uri = f"http://{USERINFO}:{PASSWORD}@{host}"
    base = ["logger=[console,jsonl,mlflow]", *secret_overrides()]
    # A sweep: Hydra's launcher lists every point's overrides; the .hydra files are smalti's, owner-only.
    sweep = run_train(tmp_path / "sweep", uri, ["-m", "optimizer.lr=1e-3,2e-3", *base])
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    assert f"tags.db_pwd={REDACTED}" in sweep.stdout + sweep.stderr
    saved = sorted((tmp_path / "sweep" / "multirun").glob("*/*/.hydra/*.yaml"))
    assert len(saved) == 6 and {p.stat().st_mode & 0o777 for p in saved} == {0o600}
    # A Slurm sweep's dry run starts no job: Hydra's sweeper still saves multirun.yaml, and lists the points.
    dry = run_train(tmp_path / "dry", uri, ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.dry_run=true",
                                           "optimizer.lr=1e-3,2e-3", *base])
    assert dry.returncode == 0 and "dry run" in dry.stdout + dry.stderr, dry.stderr[-4000:]
    for sweep_file in [*(tmp_path / "sweep" / "multirun").glob("*/multirun.yaml"),
                       *(tmp_path / "dry" / "multirun").glob("*/multirun.yaml")]:
        assert not sweep_file.is_symlink() and sweep_file.stat().st_mode & 0o777 == 0o600
        assert "db_password: '***'" in sweep_file.read_text()
    # A job that fails after it started: Hydra prints its overrides and the traceback.
    failed = run_train(tmp_path / "fail", uri, ["-m", *base, "callbacks=[progress_bar,profiler]",
                                                    "callbacks.profiler.wait=0", "callbacks.profiler.warmup=0",
                                                    "callbacks.profiler.active=1",
                                                    "callbacks.profiler.trace_dir=/dev/null/traces"])
    assert failed.returncode != 0 and "Error executing job with overrides" in failed.stderr, failed.stderr[-4000:]
    # A config error quoting the bad value, which the command line also gave as a secret.
    bad = run_train(tmp_path / "bad", uri, [*base, f"trainer.max_duration={BAD_VALUE}",
                                           f"+logger.mlflow.tags.auth={BAD_VALUE}"])
    assert bad.returncode == 2 and "max_duration" in bad.stderr, bad.stderr[-4000:]
    for out in (sweep, dry, failed, bad):
        no_canary_anywhere(out, tmp_path, mlflow_server.root)


def test_hydra_cfg_prints_the_config_without_secrets(tmp_path):
    """``--cfg job`` prints the composed config with ``print``, outside logging: it is redacted too."""
    out = subprocess.run([sys.executable, "-m", "smalti.core.cli.train", "--cfg", "job", *secret_overrides()],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "db_pwd: ***" in out.stdout, out.stderr[-3000:]
    assert [c for c in MORE if c in out.stdout + out.stderr] == []
