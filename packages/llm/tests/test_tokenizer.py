"""Tokenizers: the shipped BPE, the byte fallback, training offline, and refusing hub names."""

from __future__ import annotations

import pytest

from smalti.llm.errors import TokenizerError
from smalti.llm.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

TEXT = "The ferryman polished a silver thimble. Ünïcode 🙂 and code: def f(x): return x\n"


def test_shipped_tokenizer_round_trips_and_compresses():
    tok = load_tokenizer("default")
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode()) / 2
    assert tok.vocab_size == 2048 and tok.eos_id != tok.pad_id


def test_byte_fallback():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.vocab_size == 258


def test_train_and_load_by_path(tmp_path):
    (tmp_path / "a.txt").write_text("lorem ipsum dolor sit amet\n\n" * 200)
    out = tmp_path / "tok" / "tokenizer.json"
    tok = train_bpe([tmp_path / "a.txt"], out, vocab_size=300)
    assert out.is_file()
    again = load_tokenizer(out.parent)
    assert again.encode("lorem ipsum") == tok.encode("lorem ipsum")
    assert len(again.encode("lorem ipsum dolor")) <= 4


def test_hub_names_are_refused():
    with pytest.raises(TokenizerError, match="never downloads") as info:
        load_tokenizer("EleutherAI/gpt-neox-20b")
    # a Hub name is told how to get a local folder, not to train a tokenizer
    assert "huggingface-cli download EleutherAI/gpt-neox-20b" in str(info.value)
    assert "tokenizer train" not in str(info.value)


def test_make_tokenizer_rebuilds_the_shipped_file_byte_for_byte(tmp_path, capsys):
    from smalti.llm import make_tokenizer
    from smalti.llm.tokenizer import shipped_tokenizer_path

    problems = make_tokenizer.source_mismatches()
    if problems:  # another Python's help text: the merges would differ, and make_tokenizer refuses (tested below)
        pytest.skip("; ".join(problems))
    out = tmp_path / "rebuilt.json"
    assert make_tokenizer.main(["--output", str(out)]) == 0
    assert "2048 tokens" in capsys.readouterr().out
    assert out.read_bytes() == shipped_tokenizer_path().read_bytes()


def test_make_tokenizer_refuses_different_training_text(tmp_path, monkeypatch, capsys):
    from smalti.llm import make_tokenizer

    monkeypatch.setattr(make_tokenizer, "topics_text", lambda: "Some other help text.\n\nAnother topic.")
    out = tmp_path / "tok.json"
    assert make_tokenizer.main(["--output", str(out)]) == 2
    assert "pydoc_data.topics" in capsys.readouterr().err and not out.exists()
    tok = make_tokenizer.make_tokenizer(out, allow_other_sources=True)
    assert out.is_file() and tok.decode(tok.encode(TEXT)) == TEXT
