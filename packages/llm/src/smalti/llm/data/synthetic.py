"""A seeded Markov-chain token source with a known entropy rate: the floor a perfect model's loss reaches."""

from __future__ import annotations

import math
from typing import Annotated

import torch
from torch.utils.data import Dataset

from smalti.core.config.types import Field, NonNegativeInt, PositiveFloat, PositiveInt
from smalti.llm._compat import standard_gamma


class MarkovTokens(Dataset):
    """Sequences from a first-order Markov chain over ``vocab_size`` tokens.

    Each token has ``branching`` possible successors with Dirichlet(``concentration``) probabilities, all
    drawn from ``seed``. :attr:`entropy_floor` is the chain's entropy rate in nats per token (the expected
    next-token cross-entropy of the true model under the stationary distribution). Sequences start from the
    stationary distribution, so every position has the same expected loss.
    """

    def __init__(
        self,
        vocab_size: Annotated[int, Field(ge=2)] = 64,
        branching: PositiveInt = 4,
        max_seq_len: PositiveInt = 64,
        num_samples: PositiveInt = 2048,
        concentration: PositiveFloat = 1.0,
        seed: NonNegativeInt = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        branching = min(branching, vocab_size)
        trans = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for s in range(vocab_size):
            succ = torch.randperm(vocab_size, generator=gen)[:branching]
            weights = standard_gamma(torch.full((branching,), float(concentration), dtype=torch.float64),
                                     generator=gen)
            trans[s, succ] = weights / weights.sum()
        self.transition = trans
        self.stationary = self._stationary(trans)
        row_entropy = -(trans * torch.where(trans > 0, trans.log(), torch.zeros_like(trans))).sum(1)
        self.entropy_floor = float((self.stationary * row_entropy).sum())
        self.uniform_loss = math.log(vocab_size)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.samples = self._sample(num_samples, max_seq_len, gen)

    @staticmethod
    def _stationary(trans: torch.Tensor) -> torch.Tensor:
        pi = torch.full((trans.shape[0],), 1.0 / trans.shape[0], dtype=torch.float64)
        for _ in range(2000):
            nxt = pi @ trans
            if torch.allclose(nxt, pi, atol=1e-12):
                break
            pi = nxt
        return pi / pi.sum()

    def _sample(self, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = torch.multinomial(self.stationary.float(), n, replacement=True, generator=gen)
        probs = self.transition.float()
        for t in range(1, length):
            out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=gen).squeeze(1)
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.samples[i]}
