"""The shipped heavy-tailed chat generator gives the length mix it promises, measured with a real chat template."""

from __future__ import annotations

import json
import statistics

import pytest

from smalti.llm.data.make_long_tail_chat import heavy_tailed_chat, main, word_costs_from
from smalti.testing.hf_tokenizers import write_chat_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Lengths and prompt shares of 2,000 conversations rendered with a Llama-3-style template."""
    from smalti.llm.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_chat_tokenizer(folder, "llama3")
    rows = heavy_tailed_chat(2000, seed=0, count_tokens=word_costs_from(folder))
    tok = load_tokenizer(folder)
    lengths, shares = [], []
    for row in rows:
        ids, mask = tok.encode_chat(row["messages"])[:2]
        lengths.append(len(ids))
        shares.append(1 - sum(mask) / len(ids))
    return rows, lengths, shares


def test_lengths_are_heavy_tailed_around_300_tokens(measured):
    _, lengths, _ = measured
    assert 260 <= statistics.median(lengths) <= 360, statistics.median(lengths)
    tail = sum(n > 3000 for n in lengths) / len(lengths)
    assert 0.004 <= tail <= 0.02, tail
    assert statistics.mean(lengths) > 1.4 * statistics.median(lengths)  # a long right tail


def test_prompts_hold_30_to_60_percent_and_conversations_are_multi_turn(measured):
    rows, lengths, shares = measured
    long_enough = [s for s, n in zip(shares, lengths) if n >= 100]
    inside = sum(0.28 <= s <= 0.62 for s in long_enough) / len(long_enough)
    assert inside >= 0.95, inside
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    assert sum(t >= 2 for t in turns) / len(turns) >= 0.4
    assert max(turns) == 4
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    for r in rows:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_seeded_and_written_whole(tmp_path):
    assert heavy_tailed_chat(50, seed=3) == heavy_tailed_chat(50, seed=3)
    assert heavy_tailed_chat(50, seed=3) != heavy_tailed_chat(50, seed=4)
    main(["--out", str(tmp_path), "--train", "30", "--eval", "5"])
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held_out)) == (30, 5)
    assert train == heavy_tailed_chat(30, seed=0) and held_out == heavy_tailed_chat(5, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl", "train.jsonl"]
