"""``smalti-llm data prepare``: text/JSONL/Parquet to MDS shards, local or in object storage.

* ``pretrain``: documents are tokenized, joined with EOS (and an optional BOS) and cut into fixed-length
  ``max_seq_len`` samples (column ``tokens``, ``ndarray:int32``); the remainder carries over to the next
  document, as LLM Foundry's concatenating converter does.
* ``finetune``: each record's prompt and response are tokenized (columns ``prompt_ids`` and
  ``response_ids``, ``ndarray:int32``; the response ends with EOS).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from smalti.llm.errors import DataError
from smalti.llm.tokenizer import Tokenizer, load_tokenizer
from smalti.storage import ObjectStore, open_store, split_url

log = logging.getLogger(__name__)


def _split_of(index: int, eval_fraction: float) -> str:
    if eval_fraction <= 0:
        return "train"
    return "eval" if (zlib.crc32(str(index).encode()) % 10_000) < eval_fraction * 10_000 else "train"


class _Writers:
    """One MDSWriter per split, created on first use."""

    def __init__(self, root: Path, columns: dict[str, str], compression: str | None, size_limit: int | str,
                 splits: bool) -> None:
        from smalti.llm.data.mds import _streaming

        self._mds = _streaming()
        self.root, self.columns, self.compression, self.size_limit, self.splits = root, columns, compression, size_limit, splits
        self.writers: dict[str, Any] = {}
        self.counts: dict[str, int] = {}

    def write(self, split: str, sample: dict[str, Any]) -> None:
        if split not in self.writers:
            out = self.root / split if self.splits else self.root
            kwargs: dict[str, Any] = {"out": str(out), "columns": self.columns, "size_limit": self.size_limit}
            if self.compression:
                kwargs["compression"] = self.compression
            self.writers[split] = self._mds.MDSWriter(**kwargs)
            self.counts[split] = 0
        self.writers[split].write(sample)
        self.counts[split] += 1

    def finish(self) -> dict[str, int]:
        for writer in self.writers.values():
            writer.finish()
        return self.counts


def _upload(local: Path, store: ObjectStore) -> None:
    """Copy ``local``'s files into ``store``; every ``index.json`` goes last so readers never see a dataset whose
    shards are missing."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == "index.json")
    for path in files:
        store.put_file(path, path.relative_to(local).as_posix())


def prepare(
    inputs: Iterable[str | os.PathLike],
    out: str,
    mode: str = "pretrain",
    tokenizer: str | Tokenizer | None = "default",
    max_seq_len: int = 2048,
    eval_fraction: float = 0.0,
    text_key: str = "text",
    prompt_key: str = "prompt",
    response_key: str = "response",
    bos: bool = False,
    wrap: bool = True,
    compression: str | None = "zstd",
    size_limit: int | str = 1 << 26,
    progress: bool | None = None,
) -> dict[str, int]:
    """Convert ``inputs`` to MDS under ``out`` (a folder or any object-store URL smalti-storage speaks: ``s3://``,
    ``gs://``, ``az://``, ``oci://``); returns samples per split.

    With ``eval_fraction > 0`` documents are assigned to ``out/train`` and ``out/eval`` by a hash of their
    position, otherwise everything goes to ``out`` itself. ``data=text_mds`` (:func:`PreparedTextMDS`) reads
    both layouts.
    """
    from smalti.llm.data.sources import iter_records

    if mode not in ("pretrain", "finetune"):
        raise DataError(f"mode={mode!r} must be 'pretrain' or 'finetune'")
    tok = load_tokenizer(tokenizer)
    # Any scheme smalti-storage speaks; opened before any work so a bad URL or missing client fails first.
    remote = open_store(out) if split_url(out)[0] != "file" else None
    staging = Path(tempfile.mkdtemp(prefix="smalti-prepare-")) if remote else Path(out)
    if not remote and staging.exists() and any(staging.iterdir()):
        raise DataError(f"output folder {out} is not empty; remove it or choose another --out")
    show = sys.stderr.isatty() if progress is None else progress
    splits = eval_fraction > 0
    try:
        if mode == "pretrain":
            writers = _Writers(staging, {"tokens": "ndarray:int32"}, compression, size_limit, splits)
            buffers: dict[str, list[int]] = {"train": [], "eval": []}
            prefix = [tok.eos_id] if bos else []
            for i, record in enumerate(tqdm(iter_records(inputs), desc="documents", unit="doc", disable=not show)):
                if text_key not in record:
                    raise DataError(f"record {i} has no {text_key!r} key (keys: {sorted(record)}); pass --text-key")
                split = _split_of(i, eval_fraction)
                buffer = buffers[split]
                buffer.extend(prefix + tok.encode(str(record[text_key])) + [tok.eos_id])
                start = 0
                while len(buffer) - start >= max_seq_len:
                    writers.write(split, {"tokens": np.asarray(buffer[start : start + max_seq_len], dtype=np.int32)})
                    start += max_seq_len
                buffers[split] = buffer[start:] if wrap else []
        else:
            writers = _Writers(
                staging, {"prompt_ids": "ndarray:int32", "response_ids": "ndarray:int32"}, compression, size_limit, splits
            )
            for i, record in enumerate(tqdm(iter_records(inputs), desc="examples", unit="ex", disable=not show)):
                if prompt_key not in record or response_key not in record:
                    raise DataError(
                        f"record {i} lacks {prompt_key!r}/{response_key!r} (keys: {sorted(record)}); "
                        "pass --prompt-key/--response-key"
                    )
                prompt = tok.encode(str(record[prompt_key]))
                response = tok.encode(str(record[response_key])) + [tok.eos_id]
                writers.write(_split_of(i, eval_fraction), {
                    "prompt_ids": np.asarray(prompt, dtype=np.int32),
                    "response_ids": np.asarray(response, dtype=np.int32),
                })
        counts = writers.finish()
        if not counts:
            raise DataError(f"no samples were written from {list(map(str, inputs))}: the input is shorter than "
                            f"max_seq_len={max_seq_len} tokens or empty")
        if remote:
            _upload(staging, remote)
    finally:
        if remote:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("wrote %s to %s", ", ".join(f"{n} {s} samples" for s, n in counts.items()), out)
    return counts


def PreparedTextMDS(  # noqa: N802 - a factory standing in for a class in configs, as TextMDS
    local: str | None = None, remote: str | None = None, split: str = "train", **kwargs: Any
) -> Any:
    """``split`` of a pretraining dataset :func:`prepare` wrote, in either of its layouts (``data=text_mds``).

    ``<local>/<split>/`` (written with ``--eval-fraction``) is read as that split. A flat ``<local>/``
    (written without it) is all ``train``; its ``eval`` is ``None``, which turns evaluation off (with a
    warning saying how to get one). With a ``remote`` the split layout is read. Other keyword arguments go
    to :func:`smalti.llm.data.mds.TextMDS`.
    """
    from smalti.llm.data.mds import TextMDS

    if remote is None and local is not None:
        root = Path(local)
        if not (root / split / "index.json").is_file():
            if not (root / "index.json").is_file():
                raise DataError(
                    f"no MDS dataset in {local}: expected {root / split / 'index.json'} (or {root / 'index.json'}); "
                    f"write one with `smalti-llm data prepare --input ... --out {local}`, or point "
                    "SMALTI_LLM_DATA / data.train.local at the folder"
                )
            if split != "train":
                log.warning("%s holds one flat dataset (prepared without --eval-fraction): it is all train, and "
                            "there is no %s split, so evaluation is off; prepare with --eval-fraction 0.01 to "
                            "hold some documents out", local, split)
                return None
            return TextMDS(local=local, split=None, **kwargs)
    return TextMDS(local=local, remote=remote, split=split, **kwargs)
