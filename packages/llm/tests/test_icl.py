"""ICL evaluation: prompts, the four task types, and that training on the corpus lifts accuracy above chance."""

from __future__ import annotations

import json

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.data.text import TokenizedText
from smalti.llm.errors import ICLError
from smalti.llm.icl import ICLTask, evaluate_tasks, load_tasks
from smalti.llm.icl.evaluate import generate_greedy, normalize_answer
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
        logits[:, :, self.answer[step]] = 1.0
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


def _learned_position_model() -> LLM:
    torch.manual_seed(1)
    # Float64 so that batching changes nothing but rounding far below any argmax margin.
    return LLM(d_model=64, n_heads=4, n_layers=2, vocab_size=2048, max_seq_len=128, position="learned",
               init_std=0.1).double().eval()


def test_generation_does_not_depend_on_the_rest_of_the_batch(tmp_path):
    """With learned absolute positions, a prompt's greedy answer is the same alone and batched with longer and
    shorter prompts (right padding: every prompt starts at position 0)."""
    tok = load_tokenizer()
    model = _learned_position_model()
    records = [json.loads(line) for line in load_tasks("default")[3].path().read_text().splitlines()[:8]]
    contexts = [r["context"] if i % 2 else "Then " + r["context"] + " and far away beyond the"
                for i, r in enumerate(records)]
    prompts = [tok.encode(c) for c in contexts]
    assert len({len(p) for p in prompts}) > 3  # lengths differ, so batching pads
    alone = [generate_greedy(model, [p], 4, tok.pad_id)[0] for p in prompts]
    assert len({tuple(a) for a in alone}) > 1  # the model's answers depend on the prompt
    with torch.no_grad():
        assert generate_greedy(model, prompts, 4, tok.pad_id) == alone
        assert generate_greedy(model, prompts[::-1], 4, tok.pad_id) == alone[::-1]

    # Through the evaluator: answers taken from the prompts alone are all matched in batches of 8.
    answers = [tok.decode(a).split("\n")[0] for a in alone]
    keep = [i for i, a in enumerate(answers) if normalize_answer(a)]
    assert len(keep) >= 4
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps({"context": contexts[i], "answer": answers[i]}) + "\n" for i in keep))
    for batch_size in (1, 8):
        task = ICLTask(label="g", dataset_uri=str(path), icl_task_type="generation_task_with_answers",
                       max_new_tokens=4, batch_size=batch_size, continuation_delimiter="")
        assert evaluate_tasks([task], model, tok, torch.device("cpu")) == {"icl/g/0shot/accuracy": 1.0}


def test_icl_callback_logs_on_its_interval():
    """The ICL callback in a Trainer with interval 2ba: icl/* metrics are logged at batches 2, 4 and 6 (and
    not again at fit end, which is batch 6)."""
    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.icl.callback import ICLEval
    from smalti.testing import MetricsRecorder

    torch.manual_seed(0)
    model = LLM(d_model=32, n_heads=2, n_layers=1, vocab_size=2048, max_seq_len=64)
    tasks = [{"label": "mc", "dataset_uri": "smalti-llm:mc_phrases.jsonl", "icl_task_type": "multiple_choice",
              "max_examples": 8},
             {"label": "gen", "dataset_uri": "smalti-llm:gen_places.jsonl",
              "icl_task_type": "generation_task_with_answers", "max_new_tokens": 2, "max_examples": 4}]
    icl = ICLEval(tasks=tasks, interval="2ba", at_fit_end=True)
    sink = MetricsRecorder()
    trainer = Trainer(model, build_dataloader(TokenizedText(max_seq_len=64), 4), "6ba",
                      optimizers=lambda p: torch.optim.AdamW(p, lr=1e-3), eval_interval=None,
                      callbacks={"icl": icl}, loggers={"sink": sink})
    trainer.fit()
    trainer.close()
    for key in ("icl/mc/0shot/accuracy", "icl/gen/0shot/accuracy"):
        assert sink.steps(key) == [2, 4, 6], sink.rows
        assert all(0.0 <= v <= 1.0 for v in sink.values(key))
