"""Tokenized text as fixed-length windows held in memory: the default recipes' data (no preparation step)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import torch
from torch.utils.data import Dataset

from smalti.core.config.types import Field, PositiveInt
from smalti.llm.errors import DataError
from smalti.llm.tokenizer import Tokenizer, load_tokenizer


def default_corpus_path() -> Path:
    """The generated English-like corpus shipped with smalti-core (``smalti/core/examples/corpus``)."""
    import importlib.util

    spec = importlib.util.find_spec("smalti.core")  # located without importing the trainer
    if spec is None or not spec.submodule_search_locations:
        raise DataError("smalti-core is not installed, so its shipped corpus is missing; pass `path`")
    return Path(next(iter(spec.submodule_search_locations))) / "examples" / "corpus" / "corpus.txt"


class TokenizedText(Dataset):
    """Documents from text/JSONL/Parquet files, tokenized, joined with EOS and cut into ``max_seq_len`` windows.

    The last ``eval_fraction`` of the tokens is the ``eval`` split. Items are ``{"input_ids": LongTensor[T]}``.
    With no ``path`` it reads the corpus shipped with smalti-core.
    """

    def __init__(
        self,
        path: str | os.PathLike | list[str] | None = None,
        tokenizer: str | Tokenizer | None = "default",
        max_seq_len: PositiveInt = 128,
        split: str = "train",
        eval_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1,
        text_key: str = "text",
    ) -> None:
        from smalti.llm.data.sources import iter_documents

        if split not in ("train", "eval"):
            raise DataError(f"split={split!r} must be 'train' or 'eval'")
        tok = load_tokenizer(tokenizer)
        files = path if isinstance(path, list | tuple) else [path or default_corpus_path()]
        docs = list(iter_documents(files, text_key))
        ids: list[int] = []
        for doc_ids in tok.encode_batch(docs):
            ids.extend(doc_ids)
            ids.append(tok.eos_id)
        data = torch.tensor(ids, dtype=torch.long)
        cut = int(len(data) * (1 - eval_fraction))
        data = data[:cut] if split == "train" else data[cut:]
        self.max_seq_len = max_seq_len
        self.count = len(data) // max_seq_len
        if self.count == 0:
            raise DataError(
                f"{files} split {split!r} has {len(data)} tokens, fewer than max_seq_len={max_seq_len}; "
                "give more text or a shorter max_seq_len"
            )
        self.tokens = data[: self.count * max_seq_len].view(self.count, max_seq_len)
        self.vocab_size = tok.vocab_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i]}
