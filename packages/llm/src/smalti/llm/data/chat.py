"""Chat finetuning data: conversations rendered with the model's chat template, loss on assistant turns only.

Rows come from JSONL files (``.jsonl``, or gzip-compressed ``.jsonl.gz``; local paths, folders of them,
``smalti-llm:<asset>`` names, or ``s3://bucket/key`` objects, fetched through smalti-streaming's storage, which
honours ``S3_ENDPOINT_URL``) or from an MDS dataset (``local``/``remote``). Two row formats:

* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}``: rendered with the
  tokenizer's chat template (:meth:`smalti.llm.hf_tokenizer.HFTokenizer.encode_chat`); every assistant turn
  is trained on (its text and the end-of-turn token the template writes), nothing else is. A conversation
  without an assistant turn is an error.
* ``{"prompt": "...", "response": "..."}``: with a chat template, the conversation user=prompt,
  assistant=response; without one (smalti's own BPE), prompt ids then response ids and EOS, as
  :class:`~smalti.llm.data.finetune.FinetuneDataset` encodes them.

MDS samples hold either ``prompt_ids``/``response_ids`` (what ``smalti-llm data prepare --mode finetune``
writes: already tokenized, loss on the response ids) or the text columns above (``messages`` as a list or a
JSON string), rendered as JSONL rows are.

Over-long examples (more than ``max_seq_len`` tokens): with ``overlong="truncate"`` (default) an example
keeps its first ``max_seq_len`` tokens, so the system prompt and the earliest turns survive and later turns are
cut; one left without any assistant token is dropped. With ``overlong="drop"`` every over-long example is
dropped. The numbers truncated and dropped are logged (a warning) and kept as ``truncated``/``dropped``.

Rows are those of ``FinetuneDataset``: ``input_ids``, ``labels`` (``-100`` except on assistant tokens),
``sequence_id`` (one id per packed example, ``-1`` on padding) and ``attention_mask``; with ``packing``
examples share rows (first-fit decreasing, the model masks attention between them), without it one example per
row. A malformed row fails naming its file and line (or MDS sample).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch.utils.data import Dataset

from smalti.core.config.types import PositiveInt
from smalti.llm.data.finetune import IGNORE_INDEX, _iterate, encode_pair, pack, packed_row, size_note
from smalti.llm.errors import DataError, TokenizerError
from smalti.llm.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")


class Example(NamedTuple):
    """Token ids of one conversation and, per token, whether it is trained on."""

    ids: list[int]
    mask: list[bool]


class RowEncoder:
    """Turns one row (``messages`` or ``prompt``/``response``) into an :class:`Example`; ``where`` names the
    row (``file:line``) in errors."""

    def __init__(self, tok: Tokenizer, messages_key: str = "messages", prompt_key: str = "prompt",
                 response_key: str = "response") -> None:
        self.tok = tok
        self.keys = (messages_key, prompt_key, response_key)
        self.has_template = getattr(tok, "chat_template", None) is not None

    def __call__(self, record: Any, where: str) -> Example:
        messages_key, prompt_key, response_key = self.keys
        if not isinstance(record, dict):
            raise DataError(f"{where}: a row must be a JSON object with {messages_key!r} or "
                            f"{prompt_key!r}/{response_key!r}, not {type(record).__name__}")
        if messages_key in record:
            return self._chat(_messages(record[messages_key], where, messages_key), where)
        if prompt_key in record and response_key in record:
            prompt, response = record[prompt_key], record[response_key]
            if not (isinstance(prompt, str) and isinstance(response, str)):
                raise DataError(f"{where}: {prompt_key!r} and {response_key!r} must be strings")
            if self.has_template:
                return self._chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                  where)
            p, r = encode_pair(self.tok, prompt, response)
            return Example(p + r, [False] * len(p) + [True] * len(r))
        raise DataError(f"{where}: the row has neither {messages_key!r} nor {prompt_key!r}/{response_key!r} "
                        f"(keys: {sorted(record)}); set messages_key/prompt_key/response_key if yours differ")

    def _chat(self, messages: list[dict[str, Any]], where: str) -> Example:
        if not self.has_template:
            raise DataError(
                f"{where}: chat rows need a tokenizer with a chat template and {self.tok.name} has none; use the "
                "model folder's tokenizer (tokenizer: ${model.pretrained}) or prompt/response rows"
            )
        try:
            ids, mask = self.tok.encode_chat(messages)  # type: ignore[attr-defined]
        except TokenizerError as exc:
            raise DataError(f"{where}: {exc}") from exc
        if not any(mask):
            raise DataError(f"{where}: the chat template rendered no assistant text for this conversation")
        return Example(ids, mask)


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):  # MDS text column
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: {key!r} is a string but not JSON ({exc.msg})") from exc
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} objects")
    for n, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)
                and message.get("role") in ROLES):
            raise DataError(f"{where}: message {n} must be an object with 'role' ({', '.join(ROLES)}) and a string "
                            f"'content'; got {json.dumps(message)[:200]}")
    if not any(m["role"] == "assistant" for m in value):
        raise DataError(f"{where}: the conversation has no assistant turn, so there is nothing to train on; add "
                        "one or remove the row")
    return value


def iter_jsonl(path: str | os.PathLike | Sequence[str | os.PathLike]) -> Iterator[tuple[str, Any]]:
    """``(file:line, record)`` for every non-blank line of JSONL files (local, folders, ``s3://``, ``.gz``)."""
    items = [path] if isinstance(path, str | os.PathLike) else list(path)
    for item in items:
        text = str(item)
        if "://" in text:
            yield from _remote_jsonl(text)
            continue
        from smalti.llm.data.sources import resolve_path

        local = resolve_path(text)
        if local.is_dir():
            files = sorted(p for p in local.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
            if not files:
                raise DataError(f"chat data folder {local} holds no .jsonl or .jsonl.gz files")
        elif local.is_file():
            files = [local]
        else:
            raise DataError(f"chat data {text!r} does not exist; give JSONL files, folders or s3:// objects")
        for f in files:
            yield from _read_jsonl(f, str(f))


def _remote_jsonl(url: str) -> Iterator[tuple[str, Any]]:
    from smalti.streaming.storage import download_file

    with tempfile.TemporaryDirectory(prefix="smalti-chat-") as tmp:
        local = Path(tmp) / Path(url.split("://", 1)[1]).name
        try:
            download_file(url, local)
        except Exception as exc:
            raise DataError(f"chat data {url} could not be fetched ({exc})") from exc
        yield from _read_jsonl(local, url)


def _read_jsonl(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    gz = name.lower().endswith(".gz")
    try:
        with gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{name}:{lineno}: not valid JSON ({exc.msg}, column {exc.colno}); each line "
                                    "must be one JSON object") from exc
                yield f"{name}:{lineno}", record
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise DataError(f"{name} cannot be read as {'gzip-compressed ' if gz else ''}UTF-8 JSONL ({exc})") from exc


def fit(examples: Sequence[Example], max_seq_len: int, overlong: str = "truncate") -> tuple[list[Example], int, int]:
    """Apply the over-long rule (module doc): the kept examples, how many were truncated, how many dropped."""
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex.ids) <= max_seq_len:
            kept.append(ex)
        elif overlong == "truncate" and any(ex.mask[:max_seq_len]):
            kept.append(Example(ex.ids[:max_seq_len], ex.mask[:max_seq_len]))
            truncated += 1
        else:
            dropped += 1
    return kept, truncated, dropped


class ChatDataset(Dataset):
    """Chat or prompt/response examples as fixed-length rows, loss on assistant tokens (module doc).

    Args:
        path: JSONL file(s), folder(s), ``smalti-llm:<asset>`` or ``s3://`` object(s); or ``local``/``remote``
            (and ``split``) for MDS.
        tokenizer: a model folder (its ``tokenizer.json`` and chat template) or any name
            :func:`~smalti.llm.tokenizer.load_tokenizer` accepts.
        max_seq_len: row length; ``packing`` fills rows with several examples.
        overlong: ``"truncate"`` or ``"drop"`` (module doc).
    """

    def __init__(
        self,
        path: str | os.PathLike | list[str] | None = None,
        tokenizer: str | Tokenizer | None = "default",
        max_seq_len: PositiveInt = 2048,
        packing: bool = True,
        overlong: Literal["truncate", "drop"] = "truncate",
        local: str | None = None,
        remote: str | None = None,
        split: str | None = None,
        messages_key: str = "messages",
        prompt_key: str = "prompt",
        response_key: str = "response",
    ) -> None:
        if overlong not in OVERLONG:
            raise DataError(f"overlong={overlong!r} must be one of {', '.join(OVERLONG)}")
        if max_seq_len < 2:
            raise DataError(f"max_seq_len={max_seq_len} must be at least 2")
        tok = load_tokenizer(tokenizer)
        self.pad_id = tok.pad_id
        self.max_seq_len = max_seq_len
        encode = RowEncoder(tok, messages_key, prompt_key, response_key)
        if path is not None:
            source = str(path)
            examples = [encode(record, where) for where, record in iter_jsonl(path)]
        elif local is not None or remote is not None:
            source = str(remote or local)
            examples = self._from_mds(local, remote, split, encode)
        else:
            raise DataError("ChatDataset needs `path` (JSONL files or s3:// objects) or `local`/`remote` (MDS)")
        self.examples, self.truncated, self.dropped = fit(examples, max_seq_len, overlong)
        if self.truncated or self.dropped:
            log.warning("%s: %d of %d examples were longer than max_seq_len=%d: %d truncated, %d dropped "
                        "(overlong=%s)", source, self.truncated + self.dropped, len(examples), max_seq_len,
                        self.truncated, self.dropped, overlong)
        if not self.examples:
            raise DataError(f"no chat examples left from {source} (read {len(examples)}, dropped {self.dropped} "
                            f"longer than max_seq_len={max_seq_len})")
        lengths = [len(ex.ids) for ex in self.examples]
        self.rows = pack(lengths, max_seq_len) if packing else [[i] for i in range(len(lengths))]
        self._size = size_note(source, len(examples), self.dropped, len(self.rows), max_seq_len, packing)

    def describe_size(self) -> str:
        """How many examples were read and how many rows they became (quoted when the rows make no batch)."""
        return self._size

    @staticmethod
    def _from_mds(local: str | None, remote: str | None, split: str | None, encode: RowEncoder) -> list[Example]:
        from smalti.llm.data.mds import open_streaming

        ds = open_streaming(local=local, remote=remote, split=split, shuffle=False)
        out = []
        for n, sample in enumerate(_iterate(ds)):
            where = f"{remote or local}{'/' + split if split else ''} sample {n}"
            if "prompt_ids" in sample and "response_ids" in sample:
                prompt, response = list(map(int, sample["prompt_ids"])), list(map(int, sample["response_ids"]))
                out.append(Example(prompt + response, [False] * len(prompt) + [True] * len(response)))
            else:
                out.append(encode(dict(sample), where))
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        examples = (self.examples[idx] for idx in self.rows[i])
        return packed_row(
            [(ex.ids, [t if m else IGNORE_INDEX for t, m in zip(ex.ids, ex.mask, strict=True)]) for ex in examples],
            self.max_seq_len, self.pad_id,
        )
