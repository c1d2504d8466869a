"""Example datasets: the shipped character corpus and a synthetic regression task."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from torch.utils.data import Dataset

from smalti.core.config.types import Field, NonNegativeFloat, PositiveInt
from smalti.core.errors import ConfigError

CORPUS_PATH = Path(__file__).with_name("corpus") / "corpus.txt"


class CharCorpus(Dataset):
    """Byte-level windows of ``seq_len + 1`` bytes from a text file (default: the shipped corpus).

    The last ``eval_fraction`` of the file is the ``eval`` split. Each item is ``{"input_ids": LongTensor}``.
    """

    def __init__(self, seq_len: PositiveInt = 64, split: Literal["train", "eval"] = "train", eval_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1, path: str | None = None) -> None:
        source = Path(path) if path else CORPUS_PATH
        if not source.is_file():
            raise ConfigError(f"data path {str(source)!r} is not a file; give a UTF-8 text file")
        if split not in ("train", "eval"):
            raise ConfigError(f"split={split!r} must be 'train' or 'eval'")
        data = torch.frombuffer(bytearray(source.read_bytes()), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - eval_fraction))
        data = data[:cut] if split == "train" else data[cut:]
        self.seq_len = seq_len
        self.windows = data[: (len(data) - 1) // seq_len * seq_len + 1]
        self.count = (len(self.windows) - 1) // seq_len
        if self.count == 0:
            raise ConfigError(f"{source} split {split!r} is shorter than seq_len={seq_len}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.seq_len
        return {"input_ids": self.windows[start : start + self.seq_len + 1]}


class SyntheticRegression(Dataset):
    """``num_samples`` pairs ``(x, y)`` with ``y = x @ W + noise`` for a fixed random ``W`` (seeded)."""

    def __init__(self, num_samples: PositiveInt = 512, in_features: PositiveInt = 16, out_features: PositiveInt = 4, noise: NonNegativeFloat = 0.01,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_features, generator=gen)
        weight = torch.randn(in_features, out_features, generator=gen)
        self.y = self.x @ weight + noise * torch.randn(num_samples, out_features, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
