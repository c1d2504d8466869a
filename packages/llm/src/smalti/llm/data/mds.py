"""Reading prepared MDS data with smalti-streaming: pretraining token windows and finetuning pairs.

smalti-streaming is imported only when one of these is built, so the rest of smalti-llm works without it.
"""

from __future__ import annotations

from collections.abc import Iterator
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


def _to_ids(tokens: Any, max_seq_len: int) -> torch.Tensor:
    if isinstance(tokens, bytes | bytearray | memoryview):
        tokens = np.frombuffer(tokens, dtype=np.int32)
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
    **kwargs: Any,
) -> Any:
    """A streaming dataset over pretraining MDS shards (column ``tokens``, int32) yielding ``{"input_ids"}``.

    Extra keyword arguments go to ``smalti.streaming.StreamingDataset`` (``predownload``, ``cache_limit``,
    ``replication``, ``batch_size``, ...).
    """
    streaming = _streaming()

    def convert(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "tokens" not in sample:
            raise DataError(f"MDS sample has no 'tokens' column (has {sorted(sample)}); prepare with "
                            "`smalti-llm data prepare --mode pretrain`")
        return {"input_ids": _to_ids(sample["tokens"], max_seq_len)}

    class _TextStreamingDataset(streaming.StreamingDataset):
        # Both ways in: indexing, and iteration (which reads shards directly, not through __getitem__).
        def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
            return convert(super().__getitem__(idx))

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for sample in super().__iter__():
                yield convert(sample)

    args = {"local": local, "remote": remote, "split": split, "shuffle": shuffle, "shuffle_seed": shuffle_seed}
    args.update(kwargs)
    return _TextStreamingDataset(**{k: v for k, v in args.items() if v is not None})
