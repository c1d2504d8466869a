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
    with pytest.raises(TokenizerError, match="never downloads"):
        load_tokenizer("EleutherAI/gpt-neox-20b")
