"""The tokenizer interface of smalti-llm, apart from the tokenizers themselves, so that every tokenizer module
(:mod:`smalti.llm.tokenizer`, :mod:`smalti.llm.hf_tokenizer`) depends on it and none on another."""

from __future__ import annotations

from collections.abc import Iterable


class Tokenizer:
    """What smalti-llm needs from a tokenizer: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``pad_id``."""

    name: str = "tokenizer"
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        raise NotImplementedError
