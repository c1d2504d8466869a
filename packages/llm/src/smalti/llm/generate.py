"""Text generation from a model folder, to look at what a finetune did (``smalti-llm generate``).

Greedy decoding by default (the same tokens as ``transformers``' ``generate(do_sample=False)``), or
temperature + top-p (nucleus) sampling with a seed. No KV cache: every step runs the whole prefix, which is
fine for a sanity check and keeps the model code single-path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """The next token from the last position's ``logits [vocab]``: argmax when ``temperature`` is 0, else a
    sample from the smallest set of most likely tokens whose probability reaches ``top_p``."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= top_p] = 0.0  # the top token always stays (its "before" is 0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: Any, prompt: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, eos_ids: Iterable[int] = ()) -> list[int]:
    """New token ids after ``prompt`` (up to ``max_new_tokens``, ending with an end-of-sequence id when one is
    produced)."""
    if not prompt:
        raise ConversionError("generate: the prompt encodes to no tokens")
    if not 0 < top_p <= 1:
        raise ConversionError(f"--top-p={top_p} must be in (0, 1]")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    stop = set(eos_ids)
    ids = torch.tensor([prompt], device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model({"input_ids": ids[:, -model.max_seq_len :]})["logits"][0, -1]
        token = next_token(logits, temperature, top_p, generator)
        new.append(token)
        if token in stop:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return new


def eos_ids(folder: str | os.PathLike, tokenizer: Any = None) -> list[int]:
    """End-of-sequence ids of a model folder: ``generation_config.json``'s, else ``config.json``'s, else the
    tokenizer's."""
    folder = Path(folder)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in value] if isinstance(value, list) else [int(value)]
    eos = getattr(tokenizer, "eos_id", None)
    return [eos] if eos is not None else []
