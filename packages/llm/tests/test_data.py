"""Data: in-memory corpus windows, the Markov floor, finetuning rows, and MDS preparation (local and S3)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from smalti.llm.data.finetune import FinetuneDataset, pack
from smalti.llm.data.synthetic import MarkovTokens
from smalti.llm.data.text import TokenizedText
from smalti.llm.errors import DataError
from smalti.llm.tokenizer import load_tokenizer


def test_corpus_windows_cover_train_and_eval():
    train, ev = TokenizedText(max_seq_len=64), TokenizedText(max_seq_len=64, split="eval")
    assert len(train) > 5 * len(ev) > 0
    assert train[0]["input_ids"].shape == (64,)
    text = load_tokenizer().decode(train[0]["input_ids"].tolist())
    assert text.startswith("A young sailor carried the broken wheel.")


def test_too_short_input_names_the_sequence_length(tmp_path):
    (tmp_path / "x.txt").write_text("short")
    with pytest.raises(DataError, match="max_seq_len=64"):
        TokenizedText(path=str(tmp_path / "x.txt"), max_seq_len=64)


def test_markov_model_loss_falls_to_the_entropy_floor():
    data = MarkovTokens(vocab_size=16, branching=3, max_seq_len=32, num_samples=1024, seed=3)
    assert 0 < data.entropy_floor < data.uniform_loss - 1
    from smalti.llm import LLM

    torch.manual_seed(0)
    model = LLM(d_model=64, n_heads=4, n_layers=1, vocab_size=16, max_seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    losses = []
    for _ in range(6):
        for batch in loader:
            loss = model.loss(model(batch), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    final = sum(losses[-8:]) / 8
    assert final < data.entropy_floor + 0.1, (final, data.entropy_floor)
    assert final > data.entropy_floor - 0.1  # cannot beat the floor by more than sampling noise


def test_packing_first_fit_decreasing():
    rows = pack([5, 3, 4, 2, 6], 8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 4, 2, 6][i] for i in r) <= 8 for r in rows)
    assert len(rows) == 3


def test_finetune_rows_train_on_responses_only(tmp_path):
    path = tmp_path / "sft.jsonl"
    pairs = [{"prompt": f"Question {i}?", "response": f" Answer {i}."} for i in range(10)]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    tok = load_tokenizer()
    packed = FinetuneDataset(str(path), max_seq_len=64, packing=True)
    single = FinetuneDataset(str(path), max_seq_len=64, packing=False)
    assert len(single) == 10 and len(packed) < 10
    row = packed[0]
    n_examples = int(row["sequence_id"].max()) + 1
    assert n_examples > 1
    labelled = row["labels"][row["labels"] != -100].tolist()
    responses = [tok.encode(p["response"]) + [tok.eos_id] for p in pairs]
    assert labelled.count(tok.eos_id) == n_examples
    assert any(labelled[: len(r)] == r for r in responses)
    pad = row["attention_mask"] == 0
    assert (row["sequence_id"][pad] == -1).all() and (row["labels"][pad] == -100).all()


def test_finetune_missing_keys_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match="prompt_key"):
        FinetuneDataset(str(path))


def test_prepare_pretrain_to_mds_and_read_back(tmp_path):
    from smalti.llm.data.mds import TextMDS
    from smalti.llm.data.prepare import prepare

    counts = prepare(["smalti-llm:finetune_tiny/train.jsonl"], str(tmp_path / "mds"), text_key="prompt",
                     max_seq_len=64, eval_fraction=0.2)
    assert counts["train"] > counts["eval"] > 0
    ds = TextMDS(local=str(tmp_path / "mds"), split="train", max_seq_len=64, shuffle=False)
    first = ds[0]["input_ids"]
    assert first.shape == (64,) and first.dtype == torch.long
    text = load_tokenizer().decode(first.tolist())
    assert "\nWh" in text


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_prepare_finetune_to_a_bucket_and_train_from_it(scheme, request, tmp_path):
    """Prepared shards go to any store smalti-storage speaks (real loopback servers), index.json last."""
    from smalti.llm.data.prepare import prepare

    bucket = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[scheme])
    remote = f"{scheme}://{bucket}/sft"
    counts = prepare(["smalti-llm:finetune_tiny/eval.jsonl"], remote, mode="finetune")
    assert counts == {"train": 60}
    ds = FinetuneDataset(local=str(tmp_path / "cache"), remote=remote, max_seq_len=64)
    direct = FinetuneDataset("smalti-llm:finetune_tiny/eval.jsonl", max_seq_len=64)
    assert len(ds) == len(direct)
    torch.testing.assert_close(ds[0]["input_ids"], direct[0]["input_ids"])


DOCS = [f"Document {i}: the ferryman counted {i * 7} copper coins by the river, then rowed home at dawn."
        for i in range(40)]


def _write_input(folder, kind: str):
    import gzip

    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    if kind == "txt":
        path = folder / "docs.txt"
        path.write_text("\n\n".join(DOCS) + "\n")
    elif kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text(lines)
    elif kind == "jsonl.gz":
        path = folder / "docs.jsonl.gz"
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "docs.parquet"
        pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), path)
    return path


def _expected_windows(seq_len: int) -> list[list[int]]:
    tok = load_tokenizer()
    flat = [t for d in DOCS for t in tok.encode(d) + [tok.eos_id]]
    return [flat[i : i + seq_len] for i in range(0, len(flat) - seq_len + 1, seq_len)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl.gz", "parquet"])
def test_cli_data_prepare_reads_every_input_format(tmp_path, capsys, kind):
    """`smalti-llm data prepare` on each input format writes the documents' tokens, EOS-joined, as 32-token
    windows that read back in order."""
    from smalti.llm.cli import main
    from smalti.llm.data.mds import TextMDS

    source = _write_input(tmp_path, kind)
    out = tmp_path / "mds"
    assert main(["data", "prepare", "--input", str(source), "--out", str(out), "--max-seq-len", "32"]) == 0
    expected = _expected_windows(32)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"train": len(expected)}
    ds = TextMDS(local=str(out), max_seq_len=32, shuffle=False)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == expected


def test_cli_data_prepare_names_a_corrupt_gzip_file(tmp_path, capsys):
    from smalti.llm.cli import main

    bad = tmp_path / "broken.jsonl.gz"
    bad.write_bytes(b'{"text": "not compressed"}\n')
    assert main(["data", "prepare", "--input", str(bad), "--out", str(tmp_path / "mds")]) == 2
    assert "broken.jsonl.gz" in capsys.readouterr().err


def test_cli_data_prepare_pretrain_to_s3(s3_bucket, tmp_path, capsys):
    """Pretraining shards written to s3:// (a real S3 endpoint on loopback) stream back with the same tokens."""
    import boto3

    from smalti.llm.cli import main
    from smalti.llm.data.mds import TextMDS

    source = _write_input(tmp_path, "jsonl.gz")
    remote = f"s3://{s3_bucket}/pretrain"
    assert main(["data", "prepare", "--input", str(source), "--out", remote, "--max-seq-len", "32",
                 "--eval-fraction", "0.25"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["train"] > counts["eval"] > 0
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="pretrain/")["Contents"]}
    assert {"pretrain/train/index.json", "pretrain/eval/index.json"} <= keys
    tok = load_tokenizer()
    for split in ("train", "eval"):
        ds = TextMDS(local=str(tmp_path / "cache" / split), remote=f"{remote}/{split}", max_seq_len=32,
                     shuffle=False)
        assert len(ds) == counts[split]
        text = tok.decode(ds[0]["input_ids"].tolist())
        assert "copper coins by the river" in text


def test_cli_data_prepare_names_an_unknown_scheme_before_any_work(tmp_path, capsys):
    from smalti.llm.cli import main

    source = tmp_path / "docs.txt"
    source.write_text("\n\n".join(DOCS))
    assert main(["data", "prepare", "--input", str(source), "--out", "nope://bucket/ds"]) == 2
    err = capsys.readouterr().err
    assert "nope://" in err and "s3" in err and "gs" in err and "Traceback" not in err
