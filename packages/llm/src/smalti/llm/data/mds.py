"""Reading prepared MDS data with smalti-streaming: pretraining token windows and finetuning pairs.

smalti-streaming is imported only when one of these is built, so the rest of smalti-llm works without it.

Token columns: an ``ndarray`` column (what ``smalti-llm data prepare`` writes, ``ndarray:int32``) declares its
dtype. A ``bytes`` column (LLM Foundry's older ``convert_dataset_hf``/``convert_dataset_json`` scripts wrote
``np.asarray(ids).tobytes()``, i.e. int64) does not, so it is read as ``token_dtype``, which defaults to
int64 as Foundry's reader does. Every id read from bytes must lie in ``[0, 2**31)``; ids of another width
read as int64 do not (unless every other id is 0), so such data fails naming the column and the
``token_dtype`` to set instead of training on garbage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from smalti.llm.errors import DataError


def _streaming() -> Any:
    try:
        import smalti.streaming as streaming
    except ImportError as exc:
        raise DataError(
            "reading MDS data needs smalti-streaming (pip install smalti-streaming); for a quick run without it "
            "use data=corpus_tiny"
        ) from exc
    return streaming


def open_streaming(**kwargs: Any) -> Any:
    """A plain ``smalti.streaming.StreamingDataset`` with ``kwargs`` (local, remote, split, shuffle, ...)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return _streaming().StreamingDataset(**kwargs)


TOKEN_DTYPES = ("int64", "int32", "uint32", "uint16")
DEFAULT_BYTES_DTYPE = "int64"  # LLM Foundry's: its convert scripts stored np.asarray(list_of_ints).tobytes()
_MAX_ID = 1 << 31


def _check_token_dtype(token_dtype: str | None) -> None:
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise DataError(f"token_dtype={token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")


def ids_from_bytes(data: bytes | bytearray | memoryview, token_dtype: str | None = None,
                   column: str = "tokens") -> np.ndarray:
    """Token ids stored as raw little-endian bytes in MDS column ``column`` (see the module docstring)."""
    _check_token_dtype(token_dtype)
    dtype = np.dtype(token_dtype or DEFAULT_BYTES_DTYPE).newbyteorder("<")
    fix = ("set token_dtype to the width the data was written with (int64, int32, uint32 or uint16; with "
           "data=text_mds: +data.train.token_dtype=int32 +data.eval.token_dtype=int32)")
    size = memoryview(data).nbytes
    if size % dtype.itemsize:
        raise DataError(f"MDS column {column!r} holds {size} bytes, not a whole number of {dtype.name} token ids "
                        f"({dtype.itemsize} bytes each); {fix}")
    arr = np.frombuffer(data, dtype=dtype)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _MAX_ID):
        bad = int(arr.max()) if int(arr.max()) >= _MAX_ID else int(arr.min())
        raise DataError(f"MDS column {column!r} (encoding 'bytes') read as {dtype.name} gives token id {bad}, not "
                        f"a valid id (0 <= id < 2**31): the ids were written with another width; {fix}")
    return arr


def _to_ids(tokens: Any, max_seq_len: int, token_dtype: str | None = None, column: str = "tokens") -> torch.Tensor:
    if isinstance(tokens, bytes | bytearray | memoryview):
        tokens = ids_from_bytes(tokens, token_dtype, column)
    arr = np.asarray(tokens)
    if arr.shape[0] < max_seq_len:
        raise DataError(
            f"an MDS sample has {arr.shape[0]} tokens, fewer than max_seq_len={max_seq_len}; prepare the data "
            f"with --max-seq-len {max_seq_len} or more"
        )
    return torch.from_numpy(arr[:max_seq_len].astype(np.int64))


def TextMDS(  # noqa: N802 - a factory standing in for a class in configs
    local: str | None = None,
    remote: str | None = None,
    split: str | None = None,
    max_seq_len: int = 2048,
    shuffle: bool = True,
    shuffle_seed: int = 17,
    token_dtype: str | None = None,
    **kwargs: Any,
) -> Any:
    """A streaming dataset over pretraining MDS shards (column ``tokens``) yielding ``{"input_ids"}``.

    ``tokens`` may be an ``ndarray`` column (smalti's own, int32) or a ``bytes`` column read as
    ``token_dtype`` (default int64, LLM Foundry's legacy layout; see the module docstring). Extra keyword
    arguments go to ``smalti.streaming.StreamingDataset`` (``predownload``, ``cache_limit``,
    ``replication``, ``batch_size``, ...).
    """
    streaming = _streaming()
    _check_token_dtype(token_dtype)

    def missing(columns: Any) -> DataError:
        return DataError(f"MDS sample has no 'tokens' column (has {sorted(columns)}); prepare with "
                         "`smalti-llm data prepare --mode pretrain`")

    class _TextStreamingDataset(streaming.StreamingDataset):
        # Every path goes through these two: samples (indexing, per-sample iteration, legacy bytes columns)
        # and whole columnar batches, which keep smalti-streaming's batch path (one copy per column).
        def transform_sample(self, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
            if "tokens" not in sample:
                raise missing(sample)
            return {"input_ids": _to_ids(sample["tokens"], max_seq_len, token_dtype)}

        def transform_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if "tokens" not in batch:
                raise missing(batch)
            tokens = batch["tokens"]
            if tokens.ndim != 2 or tokens.shape[1] < max_seq_len:
                raise DataError(
                    f"an MDS sample has {tokens.shape[-1] if tokens.ndim else 0} tokens, fewer than "
                    f"max_seq_len={max_seq_len}; prepare the data with --max-seq-len {max_seq_len} or more")
            return {"input_ids": tokens[:, :max_seq_len].to(torch.int64).contiguous()}

    args = {"local": local, "remote": remote, "split": split, "shuffle": shuffle, "shuffle_seed": shuffle_seed}
    args.update(kwargs)
    return _TextStreamingDataset(**{k: v for k, v in args.items() if v is not None})
