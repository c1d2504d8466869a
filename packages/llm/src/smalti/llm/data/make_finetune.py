"""Writes the finetuning pairs shipped in ``smalti/llm/assets/finetune_tiny`` (byte-identical on every run).

Each prompt is a sentence in the style of smalti-core's corpus followed by ``Who:`` or ``What:``; the
response is the sentence's subject or object. Learnable by a tiny model, so ``experiment=finetune_tiny``
shows the response-only loss falling. Run ``python -m smalti.llm.data.make_finetune`` to write them again.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from smalti.llm.icl.make_tasks import PHRASES, PLACES, SUBJECTS, VERBS


def _pairs(rng: random.Random, n: int) -> list[dict[str, str]]:
    out = []
    for _ in range(n):
        subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
        head, end = rng.choice(PHRASES)
        place_head, place = rng.choice(PLACES)
        sentence = f"{subject} {verb} {head} {end} {place_head} {place}."
        if rng.random() < 0.5:
            out.append({"prompt": f"{sentence}\nWho:", "response": f" {subject.lower()}"})
        else:
            out.append({"prompt": f"{sentence}\nWhat:", "response": f" {head} {end}"})
    return out


def main(out: Path | None = None) -> None:
    """Write ``train.jsonl`` (600 pairs) and ``eval.jsonl`` (60 pairs)."""
    out = out or Path(str(resources.files("smalti.llm") / "assets" / "finetune_tiny"))
    rng = random.Random(11)
    for name, n in (("train.jsonl", 600), ("eval.jsonl", 60)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in _pairs(rng, n)), encoding="utf-8")


if __name__ == "__main__":
    main()
