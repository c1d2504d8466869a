"""Writes ``corpus/corpus.txt``: English-like sentences from a small seeded grammar.

Why generated: it is free of any licence question, it is the same on every machine, and its structure
(agreement, fixed phrases, punctuation) is learnable, so a byte-level model's loss visibly falls in a
few hundred steps. Run ``python -m smalti.core.examples.make_corpus`` to write it again (byte-identical).
"""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the miller", "a young sailor", "the old clockmaker", "my sister", "the weaver", "a tired soldier",
            "the baker's boy", "the night watchman", "a travelling painter", "the ferryman"]
VERBS = ["carried", "painted", "mended", "found", "sold", "buried", "counted", "polished", "lost", "remembered"]
OBJECTS = ["a blue lantern", "the broken wheel", "seven copper coins", "a letter from the north", "the tiles of the chapel",
           "an old map", "the smallest boat", "a basket of pears", "the glass beads", "a silver thimble"]
PLACES = ["by the river", "in the market", "under the bridge", "at the harbour", "behind the mill", "on the hill",
          "in the square", "near the gate"]
TIMES = ["at dawn", "before the storm", "after supper", "in the spring", "on a grey morning", "late at night"]
LINKS = ["and then", "but later", "so that evening", "because of that", "while everyone slept"]


def sentence(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(PLACES))
    if rng.random() < 0.4:
        parts.append(rng.choice(TIMES))
    text = " ".join(parts)
    if rng.random() < 0.3:
        text += f", {rng.choice(LINKS)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return text[0].upper() + text[1:] + "."


def make_corpus(num_paragraphs: int = 900, seed: int = 1234) -> str:
    rng = random.Random(seed)
    paragraphs = [" ".join(sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(num_paragraphs)]
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus") / "corpus.txt"
    out.write_text(make_corpus(), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
