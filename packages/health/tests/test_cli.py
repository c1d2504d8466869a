"""The ``smalti-health`` command line: ``--json`` on every command, exit codes, errors naming the bad value."""

import json
import subprocess
import sys

import pytest

from smalti.health.cli import BAD_INPUT_EXIT, NO_GPU_EXIT, main


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_cordon_commands_print_json(tmp_path, capsys):
    path = str(tmp_path / "cordon.json")
    assert main(["cordon", "add", "node-1", "--reason", "XID 95", "--file", path, "--json"]) == 0
    assert _json(capsys) == [{"host": "node-1", "reason": "XID 95"}]
    assert main(["cordon", "add", "node-2", "--reason", "slow NIC", "--file", path, "--json"]) == 0
    assert [e["host"] for e in _json(capsys)] == ["node-1", "node-2"]
    assert main(["cordon", "remove", "node-1", "--file", path, "--json"]) == 0
    assert _json(capsys) == [{"host": "node-2", "reason": "slow NIC"}]
    assert main(["cordon", "list", "--file", path, "--json"]) == 0
    assert _json(capsys) == [{"host": "node-2", "reason": "slow NIC"}]


def test_single_process_collectives_and_compute_print_json(capsys):
    assert main(["collectives", "--ops", "all_reduce,all_gather", "--min-bytes", "1024", "--max-bytes", "4096",
                 "--iters", "2", "--json"]) == 0
    rows = _json(capsys)
    assert [r["name"] for r in rows] == ["all_reduce/1024", "all_reduce/4096", "all_gather/1024", "all_gather/4096"]
    assert all(r["metrics"][f"health/collectives/{r['name']}/algbw_gbps"] > 0 for r in rows)
    assert main(["compute", "--size", "128", "--seconds", "0.1", "--json"]) == 0
    (row,) = _json(capsys)
    assert row["verdict"] == "ok" and row["metrics"]["health/compute/tflops"] > 0


@pytest.mark.parametrize("argv, named", [
    (["collectives", "--ops", "allreduce"], "'allreduce'"),
    (["collectives", "--min-bytes", "0"], "--min-bytes 0"),
    (["cordon", "add", "--file", "c.json"], "needs a HOST"),
    (["cordon", "list", "--file", "s3://only-a-bucket"], "s3://only-a-bucket"),
])
def test_bad_input_exits_2_naming_the_value(argv, named, capsys):
    assert main(argv) == BAD_INPUT_EXIT
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_corrupt_cordon_file_names_the_file(tmp_path, capsys):
    bad = tmp_path / "cordon.json"
    bad.write_text("cordoned: [\n")
    assert main(["cordon", "list", "--file", str(bad)]) == BAD_INPUT_EXIT
    assert str(bad) in capsys.readouterr().err


def test_gpu_json_without_a_gpu_exits_with_the_no_gpu_code():
    out = subprocess.run([sys.executable, "-m", "smalti.health.cli", "gpu", "--json"], capture_output=True,
                         text=True, timeout=60)
    rows = json.loads(out.stdout)
    if rows[0]["name"] != "gpu":
        pytest.skip("this machine has a GPU")
    assert out.returncode == NO_GPU_EXIT == 4 and "Traceback" not in out.stderr
    assert rows[0]["verdict"] == "ok" and rows[0]["message"].startswith("no GPU")
