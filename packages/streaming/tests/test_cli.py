"""``smalti-streaming`` commands as a user runs them."""

import json

from smalti.streaming import read_shard_samples
from smalti.streaming.cli import main


def test_convert_jsonl_inspect_verify(tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}", "n": i}) + "\n" for i in range(50)))
    assert main(["convert", str(src), str(tmp_path / "mds"), "--size-limit", "256"]) == 0
    assert [s["n"] for s in read_shard_samples(tmp_path / "mds")] == list(range(50))
    assert main(["inspect", str(tmp_path / "mds")]) == 0
    out = capsys.readouterr().out
    assert "samples: 50" in out and "column text: str" in out
    assert main(["verify", str(tmp_path / "mds")]) == 0
    shard = sorted((tmp_path / "mds").glob("shard.*"))[1]
    shard.write_bytes(shard.read_bytes()[:-3])
    assert main(["verify", str(tmp_path / "mds")]) == 1
    assert f"BAD {shard.name}" in capsys.readouterr().out


def test_convert_parquet_and_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", "c"], "score": [0.5, 1.5, 2.5]}), tmp_path / "t.parquet")
    assert main(["convert", str(tmp_path / "t.parquet"), str(tmp_path / "p")]) == 0
    assert [s["score"] for s in read_shard_samples(tmp_path / "p")] == [0.5, 1.5, 2.5]
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"text {i}")
    assert main(["convert", str(tmp_path / "docs"), str(tmp_path / "t"), "--format", "text"]) == 0
    assert [s["text"] for s in read_shard_samples(tmp_path / "t")] == ["text 0", "text 1", "text 2"]


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "cannot read MDS index" in capsys.readouterr().err
