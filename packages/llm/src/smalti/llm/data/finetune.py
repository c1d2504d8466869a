"""Supervised finetuning data: prompt/response pairs, loss on the response only, packed rows with sequence ids."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from smalti.core.config.types import PositiveInt
from smalti.llm.errors import DataError
from smalti.llm.tokenizer import Tokenizer, load_tokenizer

IGNORE_INDEX = -100


def encode_pair(tok: Tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids of a prompt and of its response followed by EOS."""
    return tok.encode(prompt), tok.encode(response) + [tok.eos_id]


def fit_pair(prompt: list[int], response: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Shorten a pair to ``max_seq_len`` tokens: drop the start of the prompt first, then the end of the response."""
    if len(response) >= max_seq_len:
        return prompt[-1:] if prompt else [], response[: max_seq_len - (1 if prompt else 0)]
    keep = max_seq_len - len(response)
    return prompt[-keep:] if keep else [], response


def pack(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of example indices into rows of at most ``max_seq_len`` tokens.

    Deterministic: ties keep the original order, so every rank builds the same rows.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    space: list[int] = []
    for i in order:
        for r, free in enumerate(space):
            if lengths[i] <= free:
                rows[r].append(i)
                space[r] -= lengths[i]
                break
        else:
            rows.append([i])
            space.append(max_seq_len - lengths[i])
    return [sorted(row) for row in rows]


def size_note(source: Any, read: int, dropped: int, rows: int, max_seq_len: int, packing: bool) -> str:
    """``"64 examples read from chat.jsonl, packed into 3 rows of max_seq_len=2048 tokens"`` (``describe_size``)."""
    kept = f", {dropped} dropped as longer than max_seq_len" if dropped else ""
    into = "packed into" if packing else "one per row:"
    return f"{read} examples read from {source}{kept}, {into} {rows} rows of max_seq_len={max_seq_len} tokens"


class FinetuneDataset(Dataset):
    """Prompt/response examples as fixed-length rows for causal LM finetuning.

    Source: JSONL/Parquet files with ``prompt_key`` and ``response_key`` (``path``), or a prompt/response MDS
    dataset written by ``smalti-llm data prepare --mode finetune`` (``local``/``remote``). Each row holds
    ``input_ids``, ``labels`` (``-100`` except on response tokens and their EOS), ``sequence_id`` (one id per
    packed example, ``-1`` on padding) and ``attention_mask``. With ``packing`` several examples share a row
    (the model masks attention across them); without it each example gets its own padded row.
    """

    def __init__(
        self,
        path: str | os.PathLike | list[str] | None = None,
        tokenizer: str | Tokenizer | None = "default",
        max_seq_len: PositiveInt = 256,
        packing: bool = True,
        prompt_key: str = "prompt",
        response_key: str = "response",
        local: str | None = None,
        remote: str | None = None,
        split: str | None = None,
    ) -> None:
        tok = load_tokenizer(tokenizer)
        self.pad_id = tok.pad_id
        self.max_seq_len = max_seq_len
        if path is not None:
            pairs = self._from_files(path, tok, prompt_key, response_key)
        elif local is not None or remote is not None:
            pairs = self._from_mds(local, remote, split)
        else:
            raise DataError("FinetuneDataset needs `path` (JSONL/Parquet) or `local`/`remote` (prepared MDS)")
        if not pairs:
            raise DataError(f"no prompt/response examples found in {path or local or remote}")
        self.examples = [fit_pair(p, r, max_seq_len) for p, r in pairs]
        lengths = [len(p) + len(r) for p, r in self.examples]
        self.rows = pack(lengths, max_seq_len) if packing else [[i] for i in range(len(lengths))]
        self._size = size_note(path or remote or local, len(pairs), 0, len(self.rows), max_seq_len, packing)

    def describe_size(self) -> str:
        """How many examples were read and how many rows they became (quoted when the rows make no batch)."""
        return self._size

    @staticmethod
    def _from_files(path: Any, tok: Tokenizer, prompt_key: str, response_key: str) -> list[tuple[list[int], list[int]]]:
        from smalti.llm.data.sources import iter_records

        files = path if isinstance(path, list | tuple) else [path]
        pairs = []
        for n, record in enumerate(iter_records(files)):
            if prompt_key not in record or response_key not in record:
                raise DataError(
                    f"record {n} of {files} lacks {prompt_key!r}/{response_key!r} (has {sorted(record)}); "
                    "set prompt_key/response_key"
                )
            pairs.append(encode_pair(tok, str(record[prompt_key]), str(record[response_key])))
        return pairs

    @staticmethod
    def _from_mds(local: str | None, remote: str | None, split: str | None) -> list[tuple[list[int], list[int]]]:
        from smalti.llm.data.mds import open_streaming

        ds = open_streaming(local=local, remote=remote, split=split, shuffle=False)
        return [(list(map(int, s["prompt_ids"])), list(map(int, s["response_ids"]))) for s in _iterate(ds)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        examples = (self.examples[idx] for idx in self.rows[i])
        return packed_row([(p + r, [IGNORE_INDEX] * len(p) + r) for p, r in examples], self.max_seq_len, self.pad_id)


def packed_row(examples: Sequence[tuple[list[int], list[int]]], max_seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One training row from ``(token ids, labels)`` examples packed in order and padded to ``max_seq_len``:
    ``input_ids``, ``labels`` (``-100`` on padding), ``sequence_id`` (the example's place in the row, ``-1`` on
    padding) and ``attention_mask``."""
    ids: list[int] = []
    labels: list[int] = []
    seq: list[int] = []
    for k, (example_ids, example_labels) in enumerate(examples):
        ids += example_ids
        labels += example_labels
        seq += [k] * len(example_ids)
    n = len(ids)
    pad = max_seq_len - n
    return {
        "input_ids": torch.tensor(ids + [pad_id] * pad, dtype=torch.long),
        "labels": torch.tensor(labels + [IGNORE_INDEX] * pad, dtype=torch.long),
        "sequence_id": torch.tensor(seq + [-1] * pad, dtype=torch.long),
        "attention_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
    }


def _iterate(ds: Any) -> Iterable[dict[str, Any]]:
    try:
        n = len(ds)
        return (ds[i] for i in range(n))
    except TypeError:
        return iter(ds)
