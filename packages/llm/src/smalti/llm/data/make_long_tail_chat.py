"""Seeded chat JSONL whose conversation lengths are heavy-tailed like real instruction data.

Benchmarks of chat finetuning (``bench/sft_vs_trl.py``) need the length mix that decides padding and packing
costs, not uniform rows. Each conversation draws

* a total length in tokens from a log-normal with median 300 and ``sigma = ln(10) / z(0.99)`` (about 0.99), so
  about 1% of conversations are longer than 3,000 tokens (clipped to 24..16,384);
* a prompt share (system + user text) uniform in 30-60% of it;
* 1-4 user/assistant exchanges (weights 4:3:2:1, fewer when the conversation is short), a system message in
  about a third of them; each side's tokens are split over its turns at random.

Message text is sentences about a small world (smalti-llm's ICL vocabulary), filled word by word to the drawn
token count less what a chat template adds (BOS and 5 tokens per message, as Llama 3's headers). With
``count_tokens`` (a word's cost in tokens, e.g. from the model's tokenizer: byte-level BPE splits on spaces, so
the costs add up) the counts are those of that tokenizer; without it a word counts 1.3.
The same ``seed`` and ``n`` always give the same conversations. ``python -m smalti.llm.data.make_long_tail_chat
--out DIR [--tokenizer FOLDER]`` writes ``train.jsonl`` and ``eval.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist
from typing import Any

from smalti.llm.icl.make_tasks import PHRASES, PLACES, SUBJECTS, VERBS

MEDIAN_TOKENS = 300
TAIL_TOKENS, TAIL_SHARE = 3000, 0.01
SIGMA = math.log(TAIL_TOKENS / MEDIAN_TOKENS) / NormalDist().inv_cdf(1 - TAIL_SHARE)
MIN_TOKENS, MAX_TOKENS = 24, 16384
PROMPT_SHARE = (0.3, 0.6)
TURN_WEIGHTS = (4, 3, 2, 1)
DEFAULT_WORD_TOKENS = 1.3
TEMPLATE_TOKENS = 5  # role header and end-of-turn tokens a chat template adds per message (Llama 3: 5)
SYSTEMS = ["You are a careful assistant who answers about the village.", "Answer in full sentences.",
           "Keep to the facts of the story and explain them."]


def _sentence(rng: random.Random) -> list[str]:
    head, end = rng.choice(PHRASES)
    place_head, place = rng.choice(PLACES)
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {head} {end} {place_head} {place}."
    return text.split()


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` positive shares at random."""
    weights = [rng.random() + 0.2 for _ in range(parts)]
    shares = [max(1, round(total * w / sum(weights))) for w in weights]
    shares[-1] = max(1, shares[-1] + total - sum(shares))
    return shares


def _text(rng: random.Random, tokens: int, cost: Callable[[str], float]) -> str:
    """Sentences whose words cost about ``tokens`` in total (at least one word)."""
    words: list[str] = []
    spent = 0.0
    while spent < tokens or not words:
        for word in _sentence(rng):
            words.append(word)
            spent += cost(word)
            if spent >= tokens:
                break
    return " ".join(words)


def heavy_tailed_chat(n: int, seed: int = 0, count_tokens: Callable[[str], int] | None = None) -> list[dict[str, Any]]:
    """``n`` conversations (``{"messages": [...]}``) with the length mix described in the module docstring."""
    rng = random.Random(seed)
    costs: dict[str, float] = {}

    def cost(word: str) -> float:
        if word not in costs:
            costs[word] = DEFAULT_WORD_TOKENS if count_tokens is None else float(count_tokens(word))
        return costs[word]

    out = []
    for _ in range(n):
        total = min(MAX_TOKENS, max(MIN_TOKENS, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))))
        prompt = max(4, round(total * rng.uniform(*PROMPT_SHARE)))
        answer = max(4, total - prompt)
        turns = min(rng.choices(range(1, len(TURN_WEIGHTS) + 1), weights=TURN_WEIGHTS)[0], max(1, total // 60))
        messages = []
        if rng.random() < 1 / 3:
            system = rng.choice(SYSTEMS)
            messages.append({"role": "system", "content": system})
            prompt -= round(sum(cost(w) for w in system.split())) + TEMPLATE_TOKENS
        # the template's role headers are prompt tokens, its end-of-turn token after a reply is trained
        prompt = max(turns * 2, prompt - 1 - 2 * turns * TEMPLATE_TOKENS + turns)
        answer = max(turns * 2, answer - turns)
        for ask, reply in zip(_split(rng, prompt, turns), _split(rng, answer, turns), strict=True):
            messages.append({"role": "user", "content": _text(rng, ask, cost)})
            messages.append({"role": "assistant", "content": _text(rng, reply, cost)})
        out.append({"messages": messages})
    return out


def write_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write ``rows`` as JSONL, complete or not at all (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def word_costs_from(tokenizer: str | os.PathLike) -> Callable[[str], int]:
    """A word's cost in tokens (with its leading space) under the tokenizer of a model folder or name."""
    from smalti.llm.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    return lambda word: len(tok.encode(" " + word))


def main(argv: list[str] | None = None) -> None:
    """Write ``train.jsonl`` and ``eval.jsonl`` (disjoint seeds) into ``--out``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=2000, help="conversations in train.jsonl")
    p.add_argument("--eval", type=int, default=100, help="conversations in eval.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="count tokens with this tokenizer (model folder or name)")
    args = p.parse_args(argv)
    count = word_costs_from(args.tokenizer) if args.tokenizer else None
    write_jsonl(heavy_tailed_chat(args.train, args.seed, count), args.out / "train.jsonl")
    write_jsonl(heavy_tailed_chat(args.eval, args.seed + 1, count), args.out / "eval.jsonl")


if __name__ == "__main__":
    main()
