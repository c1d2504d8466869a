"""`smalti-llm data prepare` output, with or without --eval-fraction, is what `data=text_mds` reads."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from smalti.core.config.schema import register_configs
from smalti.llm.errors import DataError
from smalti.llm.tokenizer import load_tokenizer

DOCS = [f"Note {i}: the lighthouse keeper logged {i * 3} ships passing the northern reef before dusk."
        for i in range(60)]


def prepare_with_cli(tmp_path, capsys, *extra):
    from smalti.llm.cli import main

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "pretrain"
    assert main(["data", "prepare", "--input", str(source), "--out", str(out), "--max-seq-len", "32", *extra]) == 0
    return out, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def text_mds(monkeypatch, folder):
    """The `data` section of `smalti-train model=gpt_tiny data=text_mds` with SMALTI_LLM_DATA=folder."""
    monkeypatch.setenv("SMALTI_LLM_DATA", str(folder))
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=["model=gpt_tiny", "data=text_mds", "model.max_seq_len=32"])
    return cfg.data


def read_all(dataset):
    return [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]


def expected_windows():
    tok = load_tokenizer()
    flat = [t for d in DOCS for t in tok.encode(d) + [tok.eos_id]]
    return [flat[i : i + 32] for i in range(0, len(flat) - 31, 32)]


def test_prepared_without_eval_fraction_is_all_train_and_evaluation_is_off(tmp_path, capsys, monkeypatch, caplog):
    out, counts = prepare_with_cli(tmp_path, capsys)
    data = text_mds(monkeypatch, out)
    train = instantiate(data.train)
    assert counts == {"train": len(train)} and read_all(train) == expected_windows()
    with caplog.at_level("WARNING"):
        assert instantiate(data.eval) is None  # smalti-train then runs without evaluation
    assert "--eval-fraction" in caplog.text and str(out) in caplog.text


def test_prepared_with_eval_fraction_gives_both_splits(tmp_path, capsys, monkeypatch):
    out, counts = prepare_with_cli(tmp_path, capsys, "--eval-fraction", "0.25")
    data = text_mds(monkeypatch, out)
    train, held_out = instantiate(data.train), instantiate(data.eval)
    assert len(train) == counts["train"] and len(held_out) == counts["eval"] > 0
    assert all(len(ids) == 32 for ids in read_all(train) + read_all(held_out))


def test_no_dataset_in_the_folder_names_it_and_the_fix(tmp_path, monkeypatch):
    data = text_mds(monkeypatch, tmp_path / "nothing")
    with pytest.raises(Exception, match=r"no MDS dataset in .*nothing.*smalti-llm data prepare") as info:
        instantiate(data.train)
    assert isinstance(info.value, DataError) or isinstance(info.value.__cause__, DataError)
