"""Running ICL tasks on a model. Each rank scores an equal share of the examples and the counts are summed,
so a sharded (FSDP) model makes the same number of forward passes on every rank."""

from __future__ import annotations

import contextlib
import logging
import re
import string
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smalti.llm.errors import ICLError
from smalti.llm.icl.tasks import ICLTask
from smalti.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if _dist()[1] > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def _max_over_ranks(n: int, device: torch.device) -> int:
    t = torch.tensor([n], dtype=torch.long, device=device)
    if _dist()[1] > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, squeeze spaces (SQuAD-style normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


class ContinuationScorer:
    """Per-continuation loss and argmax agreement for ``(context_ids, continuation_ids)`` pairs, batched."""

    def __init__(self, model: Callable[[dict[str, torch.Tensor]], Any], pad_id: int, max_seq_len: int,
                 batch_size: int, device: torch.device) -> None:
        self.model, self.pad_id, self.max_seq_len = model, pad_id, max_seq_len
        self.batch_size, self.device = batch_size, device

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model({"input_ids": ids})
        return out["logits"] if isinstance(out, dict) else out

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, int, bool]]:
        """``(sum of continuation NLL, continuation length, all argmax correct)`` per pair."""
        n_batches = -(-len(pairs) // self.batch_size)
        n_batches = _max_over_ranks(n_batches, self.device)
        results: list[tuple[float, int, bool]] = []
        for b in range(n_batches):
            chunk = pairs[b * self.batch_size : (b + 1) * self.batch_size] or [([self.pad_id], [self.pad_id])]
            rows, spans = [], []
            for ctx, cont in chunk:
                cont = cont[-self.max_seq_len + 1 :] if len(cont) >= self.max_seq_len else cont
                seq = (ctx + cont)[-self.max_seq_len :]
                rows.append(seq)
                spans.append((len(seq) - len(cont), len(seq)))
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r)
            ids = ids.to(self.device)
            logits = self._logits(ids).float()
            if b * self.batch_size >= len(pairs):
                continue  # a padding batch that keeps ranks in step
            for i, (start, end) in enumerate(spans):
                pred = logits[i, start - 1 : end - 1]
                target = ids[i, start:end]
                nll = F.cross_entropy(pred, target, reduction="sum")
                results.append((float(nll), end - start, bool((pred.argmax(-1) == target).all())))
        return results


def _shard(n: int) -> list[int]:
    rank, world = _dist()
    per_rank = -(-n // world)
    return [i for i in range(rank * per_rank, min(n, (rank + 1) * per_rank))]


def _max_len(task: ICLTask, model: nn.Module) -> int:
    model_len = getattr(model, "max_seq_len", None) or 2048
    return min(task.max_seq_len or model_len, model_len)


def evaluate_task(task: ICLTask, model: Any, tokenizer: Tokenizer, device: torch.device,
                  raw_model: nn.Module | None = None) -> dict[str, float]:
    """Accuracy of ``model`` on ``task`` for each ``num_fewshot``: ``{"<n>shot/accuracy": value}``."""
    raw = raw_model if raw_model is not None else model
    records = task.examples()
    max_len = _max_len(task, raw)
    scorer = ContinuationScorer(model, tokenizer.pad_id, max_len, task.batch_size, device)
    enc = tokenizer.encode
    d = task.continuation_delimiter
    out: dict[str, float] = {}
    mine = _shard(len(records))
    for k in task.num_fewshot:
        correct = 0.0
        if task.icl_task_type == "generation_task_with_answers":
            correct = _generation_correct(task, model, tokenizer, records, mine, k, max_len, device)
        else:
            pairs: list[tuple[list[int], list[int]]] = []
            groups: list[tuple[int, int, int]] = []  # (first pair, count, gold)
            for i in mine:
                rec = records[i]
                prefix = task.fewshot_prefix(records, i, k)
                kind = task.icl_task_type
                if kind == "language_modeling":
                    options = [(prefix + rec["context"], d + rec["continuation"])]
                elif kind == "multiple_choice":
                    options = [(prefix + rec["query"], d + c) for c in rec["choices"]]
                else:
                    options = [(prefix + c, d + rec["continuation"]) for c in rec["context_options"]]
                groups.append((len(pairs), len(options), int(rec.get("gold", 0))))
                pairs.extend((enc(c), enc(x)) for c, x in options)
            scores = scorer.score(pairs)
            for first, count, gold in groups:
                if task.icl_task_type == "language_modeling":
                    correct += float(scores[first][2])
                else:
                    mean_nll = [scores[first + j][0] / max(scores[first + j][1], 1) for j in range(count)]
                    correct += float(min(range(count), key=mean_nll.__getitem__) == gold)
        total_correct, total = _all_reduce_sum([correct, float(len(mine))], device)
        out[f"{k}shot/accuracy"] = total_correct / max(total, 1.0)
    return out


def _generation_correct(task: ICLTask, model: Any, tokenizer: Tokenizer, records: list[dict[str, Any]],
                        mine: list[int], k: int, max_len: int, device: torch.device) -> float:
    """Greedy generation for this rank's examples in batches; the normalised text must start with an answer."""
    n_batches = _max_over_ranks(-(-len(mine) // task.batch_size), device)
    correct = 0.0
    for b in range(n_batches):
        idx = mine[b * task.batch_size : (b + 1) * task.batch_size]
        prompts = [
            tokenizer.encode(task.fewshot_prefix(records, i, k) + records[i]["context"]
                             + task.continuation_delimiter.rstrip())[-(max_len - task.max_new_tokens):]
            for i in idx
        ] or [[tokenizer.pad_id]]
        new = generate_greedy(model, prompts, task.max_new_tokens, tokenizer.pad_id, device)
        for row, i in zip(new, idx):
            text = tokenizer.decode(row)
            text = text.split(task.example_delimiter)[0] if task.example_delimiter else text
            answers = [records[i]["answer"], *records[i].get("aliases", [])]
            got = normalize_answer(text)
            correct += float(any(normalize_answer(a) and got.startswith(normalize_answer(a)) for a in answers))
    return correct


@torch.no_grad()
def generate_greedy(model: Any, prompts: list[list[int]], steps: int, pad_id: int,
                    device: torch.device | None = None) -> list[list[int]]:
    """``steps`` greedy tokens after each of ``prompts``, decoded together as one batch.

    Rows are right-padded: every prompt starts at position 0, whatever the other prompts' lengths, so learned
    absolute positions see the same positions as for the prompt alone, and causal attention keeps the padding
    (always after a row's last real token) out of every prediction. Each row's next token is read at its own
    last position and written after it. Always runs ``steps`` forward passes (sharded ranks stay in step).
    """
    lengths = [len(p) for p in prompts]
    if min(lengths, default=0) < 1:
        raise ICLError(f"generation needs non-empty prompts; prompt lengths were {lengths}")
    longest = max(lengths)
    ids = torch.full((len(prompts), longest + steps), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(device) if device is not None else ids
    rows = torch.arange(len(prompts), device=ids.device)
    ends = torch.tensor(lengths, device=ids.device)  # where each row's next token goes
    new = []
    for step in range(steps):
        out = model({"input_ids": ids[:, : longest + step]})
        logits = out["logits"] if isinstance(out, dict) else out
        nxt = logits[rows, ends - 1].argmax(-1)
        ids[rows, ends] = nxt
        ends = ends + 1
        new.append(nxt)
    return torch.stack(new, 1).tolist() if new else [[] for _ in prompts]


def evaluate_tasks(tasks: list[ICLTask], model: Any, tokenizer: Tokenizer, device: torch.device | None = None,
                   raw_model: nn.Module | None = None, autocast: Any = None) -> dict[str, float]:
    """Run every task; returns ``{"icl/<label>/<n>shot/accuracy": value}``."""
    raw = raw_model if raw_model is not None else model
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    results: dict[str, float] = {}
    try:
        with torch.no_grad(), (autocast or contextlib.nullcontext()):
            for task in tasks:
                for key, value in evaluate_task(task, model, tokenizer, device, raw).items():
                    results[f"icl/{task.label}/{key}"] = value
    finally:
        raw.train(was_training)
    return results
