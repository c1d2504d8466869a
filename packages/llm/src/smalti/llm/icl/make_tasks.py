"""Writes the ICL task files shipped in ``smalti/llm/assets/icl`` (byte-identical on every run).

The tasks probe the phrases of smalti-core's generated corpus (the default recipe's training text), so a
model trained by ``experiment=gpt_tiny`` scores visibly above chance while an untrained one does not.
Run ``python -m smalti.llm.icl.make_tasks`` to write them again.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

SUBJECTS = ["The miller", "A young sailor", "The old clockmaker", "My sister", "The weaver", "A tired soldier",
            "The night watchman", "A travelling painter", "The ferryman"]
VERBS = ["carried", "painted", "mended", "found", "sold", "buried", "counted", "polished", "lost", "remembered"]
# Objects whose last word is fixed by the words before it.
PHRASES = [("a basket of", "pears"), ("seven copper", "coins"), ("a letter from the", "north"),
           ("the tiles of the", "chapel"), ("the glass", "beads"), ("a silver", "thimble"), ("a blue", "lantern"),
           ("the broken", "wheel"), ("the smallest", "boat")]
PLACES = [("by the", "river"), ("in the", "market"), ("under the", "bridge"), ("at the", "harbour"),
          ("behind the", "mill"), ("on the", "hill"), ("near the", "gate")]


def _tasks(rng: random.Random, n: int = 40) -> dict[str, list[dict]]:
    lm, mc, schema, gen = [], [], [], []
    endings = [end for _, end in PHRASES]
    for _ in range(n):
        subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
        head, end = rng.choice(PHRASES)
        lm.append({"context": f"{subject} {verb} {head}", "continuation": end})
        wrong = rng.sample([e for e in endings if e != end], 3)
        choices = [end, *wrong]
        rng.shuffle(choices)
        mc.append({"query": f"{subject} {verb} {head}", "choices": choices, "gold": choices.index(end)})
        other_head = rng.choice([h for h, e in PHRASES if e != end])
        options = [f"{subject} {verb} {head}", f"{subject} {verb} {other_head}"]
        rng.shuffle(options)
        schema.append({"context_options": options, "continuation": f"{end}.",
                       "gold": options.index(f"{subject} {verb} {head}")})
        place_head, place = rng.choice(PLACES)
        gen.append({"context": f"{subject} {verb} {head} {end} {place_head}", "answer": place,
                    "aliases": [f"{place}."]})
    return {"lm_phrases.jsonl": lm, "mc_phrases.jsonl": mc, "schema_phrases.jsonl": schema,
            "gen_places.jsonl": gen}


def main(out: Path | None = None) -> None:
    """Write the four task files."""
    out = out or Path(str(resources.files("smalti.llm") / "assets" / "icl"))
    for name, records in _tasks(random.Random(7)).items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


if __name__ == "__main__":
    main()
