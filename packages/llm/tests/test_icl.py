"""ICL evaluation: prompts, the four task types, and that training on the corpus lifts accuracy above chance."""

from __future__ import annotations

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.data.text import TokenizedText
from smalti.llm.errors import ICLError
from smalti.llm.icl import ICLTask, evaluate_tasks, load_tasks
from smalti.llm.icl.evaluate import normalize_answer
from smalti.llm.tokenizer import load_tokenizer


def _trained_model(steps: int) -> LLM:
    torch.manual_seed(0)
    model = LLM(d_model=128, n_heads=4, n_layers=4, vocab_size=2048, max_seq_len=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    loader = torch.utils.data.DataLoader(TokenizedText(max_seq_len=128), batch_size=32, shuffle=True)
    done = 0
    while done < steps:
        for batch in loader:
            loss = model.loss(model(batch), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if done == steps:
                break
    return model


def test_fewshot_prompt_uses_other_examples():
    task = load_tasks("default")[1]
    records = task.examples()
    prefix = task.fewshot_prefix(records, 0, 2)
    assert prefix.count("\n") == 2
    assert records[0]["query"] not in prefix.split("\n")[:2] or len(set(r["query"] for r in records)) < len(records)
    with pytest.raises(ICLError, match="num_fewshot"):
        task.fewshot_prefix(records, 0, len(records))


def test_training_on_the_corpus_beats_chance_on_shipped_tasks():
    tasks = load_tasks("default")
    tok = load_tokenizer()
    untrained = evaluate_tasks(tasks, _trained_model(0), tok)
    trained = evaluate_tasks(tasks, _trained_model(40), tok)
    assert set(trained) == {
        "icl/lm_phrases/0shot/accuracy", "icl/mc_phrases/0shot/accuracy", "icl/mc_phrases/2shot/accuracy",
        "icl/schema_phrases/0shot/accuracy", "icl/gen_places/1shot/accuracy",
    }
    assert untrained["icl/mc_phrases/0shot/accuracy"] < 0.5  # 4 choices: chance is 0.25
    assert trained["icl/mc_phrases/0shot/accuracy"] > untrained["icl/mc_phrases/0shot/accuracy"] + 0.25
    assert trained["icl/schema_phrases/0shot/accuracy"] > untrained["icl/schema_phrases/0shot/accuracy"]
    assert trained["icl/lm_phrases/0shot/accuracy"] > untrained["icl/lm_phrases/0shot/accuracy"]


class _Parrot(torch.nn.Module):
    """Always continues with a fixed token sequence, whatever the prompt."""

    def __init__(self, answer_ids: list[int], vocab: int) -> None:
        super().__init__()
        self.answer, self.vocab, self.max_seq_len = answer_ids, vocab, 512
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.start = None

    def forward(self, batch):
        ids = batch["input_ids"]
        if self.start is None or ids.shape[1] <= self.start:
            self.start = ids.shape[1]
        step = min(ids.shape[1] - self.start, len(self.answer) - 1)
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.vocab)
        logits[:, -1, self.answer[step]] = 1.0
        return {"logits": logits}


def test_generation_matches_normalised_answer_prefix(tmp_path):
    tok = load_tokenizer()
    path = tmp_path / "gen.jsonl"
    path.write_text('{"context": "Where?", "answer": "The River"}\n{"context": "Where?", "answer": "the hill"}\n')
    task = ICLTask(label="g", dataset_uri=str(path), icl_task_type="generation_task_with_answers", max_new_tokens=3)
    parrot = _Parrot(tok.encode(" river, now") + [tok.eos_id] * 3, tok.vocab_size)
    result = evaluate_tasks([task], parrot, tok, torch.device("cpu"))
    assert result["icl/g/0shot/accuracy"] == 0.5
    assert normalize_answer("The  River!") == "river"


def test_bad_task_files_are_named(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"query": "q", "choices": ["a"]}\n')
    task = ICLTask(label="mc", dataset_uri=str(path), icl_task_type="multiple_choice")
    with pytest.raises(ICLError, match="gold"):
        task.examples()
    with pytest.raises(ICLError, match="icl_task_type"):
        ICLTask(label="x", dataset_uri=str(path), icl_task_type="code_evaluation")
