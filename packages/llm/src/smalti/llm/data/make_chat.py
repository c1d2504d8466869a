"""Writes the chat conversations shipped in ``smalti/llm/assets/chat_tiny`` (byte-identical on every run).

Each conversation is about one sentence in the style of smalti-core's corpus: the user gives the sentence and
asks who did it, what they handled, or where; follow-up turns ask another of these about the same sentence, so
answering needs the earlier turns. About half the conversations open with a system message. Answers are spans
of the sentence, learnable by a tiny model, so ``experiment=finetune_hf`` shows the assistant-token loss
falling. Run ``python -m smalti.llm.data.make_chat`` to write them again.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from smalti.llm.icl.make_tasks import PHRASES, PLACES, SUBJECTS, VERBS

SYSTEMS = ["Answer with a short phrase from the story.", "You answer questions about one sentence.",
           "Be brief."]
FIRST = {"who": ["Who {verb} it?", "Who was it?"], "what": ["What was {verb}?", "What did they handle?"],
         "where": ["Where did it happen?", "Where was that?"]}
FOLLOW = {"who": ["And who was it?", "Who did that?"], "what": ["And what was it?", "What was it again?"],
          "where": ["And where?", "Where was it?"]}


def _conversations(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
        head, end = rng.choice(PHRASES)
        place_head, place = rng.choice(PLACES)
        answers = {"who": f"{subject}.", "what": f"{head} {end}.".capitalize(),
                   "where": f"{place_head} {place}.".capitalize()}
        asks = rng.sample(list(answers), rng.choice((1, 2, 2, 3)))
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
        sentence = f"{subject} {verb} {head} {end} {place_head} {place}."
        for k, ask in enumerate(asks):
            question = rng.choice((FIRST if k == 0 else FOLLOW)[ask]).format(verb=verb)
            messages.append({"role": "user", "content": f"{sentence} {question}" if k == 0 else question})
            messages.append({"role": "assistant", "content": answers[ask]})
        out.append({"messages": messages})
    return out


def main(out: Path | None = None) -> None:
    """Write ``train.jsonl`` (320 conversations) and ``eval.jsonl`` (40)."""
    out = out or Path(str(resources.files("smalti.llm") / "assets" / "chat_tiny"))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(13)
    for name, n in (("train.jsonl", 320), ("eval.jsonl", 40)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _conversations(rng, n))
        (out / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
