"""The cordon list, local and on a real loopback S3 endpoint, as the core's launch tools read it."""

import json
import multiprocessing as mp

import pytest

from smalti.core.launch.cordon import parse_cordon, read_cordon_file
from smalti.health.cli import main
from smalti.health.cordon import add_to_cordon, is_cordoned, read_cordon, remove_from_cordon
from smalti.health.errors import HealthError


def test_add_list_remove_locally_and_core_reads_the_same_list(tmp_path, capsys):
    path = str(tmp_path / "ops" / "cordon.json")
    add_to_cordon(path, "node-a", "XID 79 on gpu3")
    add_to_cordon(path, "node-b", "busbw 12 GB/s")
    add_to_cordon(path, "node-a", "XID 48 on gpu0")  # re-cordoning updates the reason
    assert [(h.host, h.reason) for h in read_cordon(path)] == [("node-b", "busbw 12 GB/s"), ("node-a", "XID 48 on gpu0")]
    assert read_cordon_file(path) == read_cordon(path)
    assert json.loads((tmp_path / "ops" / "cordon.json").read_text())["cordoned"][1]["time"].endswith("Z")
    assert is_cordoned(path, "node-a") == "XID 48 on gpu0" and is_cordoned(path, "node-c") is None
    assert remove_from_cordon(path, "node-b") and not remove_from_cordon(path, "node-b")
    assert main(["cordon", "list", "--file", path]) == 0
    assert capsys.readouterr().out == "node-a\tXID 48 on gpu0\n"
    assert [p.name for p in (tmp_path / "ops").iterdir()] == ["cordon.json"]  # no temp or lock files left


def _add_many(path, prefix, n):
    for i in range(n):
        add_to_cordon(path, f"{prefix}-{i}", "test")


def test_concurrent_adds_from_two_processes_all_land(tmp_path):
    path = str(tmp_path / "cordon.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_add_many, args=(path, p, 15)) for p in ("x", "y")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(read_cordon(path)) == 30


def test_a_file_that_is_not_a_cordon_list_names_the_file(tmp_path):
    bad = tmp_path / "cordon.json"
    bad.write_text("[{\"reason\": \"no host\"}]")
    with pytest.raises(HealthError, match=f"{bad}.*entry 0"):
        read_cordon(str(bad))
    assert main(["cordon", "add", "node-z", "--file", str(bad)]) == 2
    assert bad.read_text() == "[{\"reason\": \"no host\"}]"  # the bad file is left as it was


def test_only_host_names_are_written_or_read(tmp_path):
    """The list is shared and launchers write its hosts into job scripts: nothing else gets in, or out."""
    path = tmp_path / "cordon.json"
    add_to_cordon(str(path), "node-a", "XID 79\nthen ECC")
    for bad in ("node-b\ntouch /tmp/x #", "node b", "$(id)"):
        with pytest.raises(HealthError, match="not a host name"):
            add_to_cordon(str(path), bad, "test")
    assert [(h.host, h.reason) for h in read_cordon(str(path))] == [("node-a", "XID 79 then ECC")]
    # A list another job tampered with is refused as a whole, naming the entry; it is left as it was.
    tampered = json.loads(path.read_text())
    tampered["cordoned"].append({"host": "gpu-9\ntouch /tmp/x #", "reason": "x"})
    path.write_text(json.dumps(tampered))
    with pytest.raises(HealthError, match="entry 1"):
        read_cordon(str(path))
    assert main(["cordon", "add", "node-z", "--file", str(path)]) == 2
    assert json.loads(path.read_text()) == tampered


def test_cordon_on_s3(s3_server, s3_bucket):
    import boto3
    import yaml

    path = f"s3://{s3_bucket}/ops/cordon.json"
    assert read_cordon(path) == []
    add_to_cordon(path, "node-a", "ECC")
    add_to_cordon(path, "node-b", "slow link")
    assert [h.host for h in read_cordon(path)] == ["node-a", "node-b"]
    body = boto3.client("s3", endpoint_url=s3_server.endpoint_url).get_object(Bucket=s3_bucket, Key="ops/cordon.json")
    assert parse_cordon(yaml.safe_load(body["Body"].read()), path) == read_cordon(path)  # the core reads it too
    assert remove_from_cordon(path, "node-a")
    assert is_cordoned(path, "node-b") == "slow link" and is_cordoned(path, "node-a") is None



def _adds_from_threads(path: str, writers: int = 3, each: int = 4) -> None:
    import threading

    threads = [threading.Thread(target=_add_many, args=(path, f"w{n}", each)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert sorted(h.host for h in read_cordon(path)) == sorted(f"w{n}-{i}" for n in range(writers) for i in range(each))


def test_concurrent_adds_on_s3_all_land(s3_server, s3_bucket):
    _adds_from_threads(f"s3://{s3_bucket}/ops/cordon.json")


def test_cordon_on_azure_blob_with_concurrent_adds(azurite_server, azure_container, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_server.connection_string())
    path = f"az://{azure_container}/ops/cordon.json"
    assert read_cordon(path) == []
    _adds_from_threads(path)
    assert remove_from_cordon(path, "w0-0") and is_cordoned(path, "w0-0") is None
    assert is_cordoned(path, "w1-1") == "test"
