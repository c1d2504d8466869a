"""Chat finetuning rows: loss only on assistant turns, packing with sequence ids, the over-long rule, JSONL
(plain, gzip, s3://) and MDS sources, and errors that name the file and line."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from smalti.llm.data.chat import ChatDataset
from smalti.llm.data.finetune import IGNORE_INDEX
from smalti.llm.data.sources import resolve_path
from smalti.llm.errors import DataError
from smalti.llm.hf_tokenizer import HFTokenizer
from smalti.testing.hf_tokenizers import write_chat_tokenizer

EVAL = "smalti-llm:chat_tiny/eval.jsonl"
END = {"llama3": "<|eot_id|>", "mistral": "</s>", "chatml": "<|im_end|>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for style in END:
        out[style] = tmp_path_factory.mktemp(style)
        write_chat_tokenizer(out[style], style)
    return out


def _conversations(name: str = EVAL) -> list[list[dict]]:
    lines = resolve_path(name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["messages"] for line in lines]


def _runs(values: list[int]) -> list[list[int]]:
    """Maximal runs of labels that are not -100."""
    runs, current = [], []
    for v in values:
        if v != IGNORE_INDEX:
            current.append(v)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("style", list(END))
def test_labels_are_exactly_the_assistant_turns(folders, style):
    """One example per row: every label run decodes to one assistant turn and its end-of-turn token, in order;
    every other position is -100 and the labels equal the input ids where set."""
    tok = HFTokenizer.from_folder(folders[style])
    ds = ChatDataset(EVAL, tokenizer=str(folders[style]), max_seq_len=256, packing=False)
    conversations = _conversations()
    assert len(ds) == len(conversations) == 40
    for row, messages in zip(ds, conversations, strict=True):
        ids, labels = row["input_ids"], row["labels"]
        set_ = labels != IGNORE_INDEX
        assert torch.equal(labels[set_], ids[set_])
        n = int(row["attention_mask"].sum())
        assert ids[:n].tolist() == tok.apply_chat_template(messages, tokenize=True)
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        decoded = [tok.decode(r, skip_special_tokens=False) for r in _runs(labels.tolist())]
        lead = " " if style == "mistral" else ""
        assert decoded == [lead + t + END[style] for t in turns]


def test_packed_rows_keep_documents_apart(folders):
    ds = ChatDataset("smalti-llm:chat_tiny/train.jsonl", tokenizer=str(folders["chatml"]), max_seq_len=256)
    assert len(ds) < len(ds.examples) / 2  # packing put several conversations in most rows
    seen = []
    for i in range(len(ds)):
        row = ds[i]
        seq, mask = row["sequence_id"], row["attention_mask"]
        n = int(mask.sum())
        assert torch.all(seq[n:] == -1) and torch.all(row["labels"][n:] == IGNORE_INDEX)
        # ids 0, 1, 2, ... in contiguous blocks, one block per packed conversation
        blocks = torch.unique_consecutive(seq[:n]).tolist()
        assert blocks == list(range(len(ds.rows[i])))
        for k, idx in enumerate(ds.rows[i]):
            assert row["input_ids"][seq == k].tolist() == ds.examples[idx].ids
        seen += ds.rows[i]
    assert sorted(seen) == list(range(len(ds.examples)))


def test_overlong_examples_truncated_or_dropped_with_counts(folders, tmp_path, caplog):
    tok = HFTokenizer.from_folder(folders["llama3"])
    long_chat = [{"role": "user", "content": "Who carried the pears?"}]
    for i in range(12):
        long_chat += [{"role": "assistant", "content": f"The miller, turn {i}."},
                      {"role": "user", "content": "And then?"}]
    long_chat = long_chat[:-1]
    short = {"prompt": "Who?", "response": "The weaver."}
    # a system prompt longer than max_seq_len leaves no assistant token after truncation
    no_room = {"messages": [{"role": "system", "content": "Be brief. " * 40}, *long_chat[:2]]}
    path = _write_jsonl(tmp_path / "long.jsonl", [{"messages": long_chat}, short, no_room])
    full = tok.encode_chat(long_chat)
    assert len(full.ids) > 64
    with caplog.at_level(logging.WARNING, logger="smalti.llm.data.chat"):
        ds = ChatDataset(str(path), tokenizer=str(folders["llama3"]), max_seq_len=64, packing=False)
    assert (ds.truncated, ds.dropped, len(ds)) == (1, 1, 2)
    assert "1 truncated, 1 dropped" in caplog.text and str(path) in caplog.text
    row = ds[0]
    assert row["input_ids"].tolist() == full.ids[:64]  # the first max_seq_len tokens are kept
    expected = [t if m else IGNORE_INDEX for t, m in zip(full.ids[:64], full.assistant_mask[:64], strict=True)]
    assert row["labels"].tolist() == expected
    dropped = ChatDataset(str(path), tokenizer=str(folders["llama3"]), max_seq_len=64, overlong="drop")
    assert (dropped.truncated, dropped.dropped, len(dropped.examples)) == (0, 2, 1)


def test_bad_rows_name_file_and_line(folders, tmp_path):
    good = {"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "The miller."}]}
    tok = str(folders["chatml"])
    cases = [
        ('{"messages": [', r":2: not valid JSON"),
        ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]},
         r":2: the conversation has no assistant turn"),
        ({"text": "no chat here"}, r":2: the row has neither 'messages' nor 'prompt'/'response'"),
        ({"messages": [{"role": "narrator", "content": "x"}]}, r":2: message 0 must be an object with 'role'"),
        ([1, 2], r":2: a row must be a JSON object"),
    ]
    for bad, message in cases:
        path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", bad])  # the blank line still counts
        with pytest.raises(DataError, match=f"{path}:3" + message.replace(":2", "")):
            ChatDataset(str(path), tokenizer=tok)
    path = _write_jsonl(tmp_path / "chat.jsonl", [good])
    with pytest.raises(DataError, match=rf"{path}:1: chat rows need a tokenizer with a chat template"):
        ChatDataset(str(path), tokenizer="default")
    with pytest.raises(DataError, match="does not exist"):
        ChatDataset(str(tmp_path / "missing.jsonl"), tokenizer=tok)


def test_mistral_template_errors_name_the_row(folders, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}]
    path = _write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError, match=rf"{path}:1: .*roles must alternate"):
        ChatDataset(str(path), tokenizer=str(folders["mistral"]))


def test_prompt_response_rows(folders, tmp_path):
    rows = [{"prompt": "Who carried the pears?", "response": "The miller."}]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    chat = ChatDataset(str(path), tokenizer=str(folders["chatml"]), max_seq_len=64)
    tok = HFTokenizer.from_folder(folders["chatml"])
    messages = [{"role": "user", "content": rows[0]["prompt"]}, {"role": "assistant", "content": rows[0]["response"]}]
    assert chat.examples[0].ids == tok.apply_chat_template(messages, tokenize=True)
    assert [tok.decode(r, skip_special_tokens=False) for r in _runs(chat[0]["labels"].tolist())] == \
        ["The miller.<|im_end|>"]
    # smalti's own BPE has no chat template: prompt ids, then response ids and EOS, as FinetuneDataset
    from smalti.llm.data.finetune import FinetuneDataset

    plain, ref = ChatDataset(str(path), max_seq_len=64), FinetuneDataset(str(path), max_seq_len=64)
    for key in ("input_ids", "labels", "sequence_id", "attention_mask"):
        assert torch.equal(plain[0][key], ref[0][key]), key


def test_gzip_and_folder_inputs_give_the_same_rows(folders, tmp_path):
    rows = [{"messages": m} for m in _conversations()]
    plain = _write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "gz").mkdir()
    packed = _write_jsonl(tmp_path / "gz" / "a.jsonl.gz", rows, gz=True)
    tok = str(folders["llama3"])
    a, b = ChatDataset(str(plain), tokenizer=tok), ChatDataset(str(packed), tokenizer=tok)
    c = ChatDataset(str(tmp_path / "gz"), tokenizer=tok)
    assert len(a) == len(b) == len(c) and len(a.examples) == 40
    for i in range(len(a)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["labels"], c[i]["labels"])
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="broken.jsonl.gz cannot be read as gzip-compressed"):
        ChatDataset(str(tmp_path / "broken.jsonl.gz"), tokenizer=tok)


def test_s3_objects(folders, tmp_path, s3_bucket):
    import os

    import boto3

    rows = [{"messages": m} for m in _conversations()]
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    client.upload_file(str(_write_jsonl(tmp_path / "c.jsonl.gz", rows, gz=True)), s3_bucket, "chat/c.jsonl.gz")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [rows[0], "{oops"])
    client.upload_file(str(bad), s3_bucket, "chat/bad.jsonl")
    tok = str(folders["chatml"])
    remote = ChatDataset(f"s3://{s3_bucket}/chat/c.jsonl.gz", tokenizer=tok)
    local = ChatDataset(EVAL, tokenizer=tok)
    assert [e.ids for e in remote.examples] == [e.ids for e in local.examples]
    with pytest.raises(DataError, match=rf"s3://{s3_bucket}/chat/bad.jsonl:2: not valid JSON"):
        ChatDataset(f"s3://{s3_bucket}/chat/bad.jsonl", tokenizer=tok)
    with pytest.raises(DataError, match=rf"s3://{s3_bucket}/chat/none.jsonl could not be fetched"):
        ChatDataset(f"s3://{s3_bucket}/chat/none.jsonl", tokenizer=tok)


def test_mds_from_data_prepare_and_chat_columns(folders, tmp_path):
    from smalti.llm.data.prepare import prepare
    from smalti.streaming import MDSWriter

    tok_dir = str(folders["chatml"])
    pairs = "smalti-llm:finetune_tiny/eval.jsonl"
    prepare([pairs], str(tmp_path / "sft"), mode="finetune", tokenizer=tok_dir)
    ds = ChatDataset(local=str(tmp_path / "sft"), tokenizer=tok_dir, max_seq_len=64, packing=False)
    tok = HFTokenizer.from_folder(folders["chatml"])
    first = json.loads(resolve_path(pairs).read_text().splitlines()[0])
    prompt, response = tok.encode(first["prompt"]), tok.encode(first["response"]) + [tok.eos_id]
    assert ds[0]["input_ids"][: len(prompt) + len(response)].tolist() == prompt + response
    assert _runs(ds[0]["labels"].tolist()) == [response]
    # MDS rows holding the conversations themselves are rendered like JSONL rows
    conversations = _conversations()
    with MDSWriter(out=str(tmp_path / "chat"), columns={"messages": "json"}) as writer:
        for messages in conversations:
            writer.write({"messages": messages})
    mds = ChatDataset(local=str(tmp_path / "chat"), tokenizer=tok_dir, packing=False, max_seq_len=256)
    jsonl = ChatDataset(EVAL, tokenizer=tok_dir, packing=False, max_seq_len=256)
    assert [e.ids for e in mds.examples] == [e.ids for e in jsonl.examples]
    shutil.rmtree(tmp_path / "chat")


def test_data_chat_config_builds_the_dataset(folders):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    conf = OmegaConf.load(resolve_path("smalti-llm:").parent / "conf" / "data" / "chat.yaml")
    root = OmegaConf.create({"model": {"pretrained": str(folders["llama3"]), "max_seq_len": 128}, "data": conf})
    train, ev = instantiate(root.data.train), instantiate(root.data.eval)
    assert isinstance(train, ChatDataset) and len(train.examples) == 320 and len(ev.examples) == 40
    assert train[0]["input_ids"].shape == (128,)
    assert train.pad_id == HFTokenizer.from_folder(folders["llama3"]).eos_id  # llama3 names no pad token
