"""ICL task definitions and their JSONL files, with few-shot prompt building.

Record formats (one JSON object per line), as LLM Foundry's local task files:

* ``language_modeling``: ``{"context", "continuation"}``: correct when the argmax of every continuation
  token is that token.
* ``multiple_choice``: ``{"query", "choices": [...], "gold": i}``: the choice with the lowest mean
  per-token loss is the answer.
* ``schema``: ``{"context_options": [...], "continuation", "gold": i}``: the context under which the
  continuation has the lowest mean per-token loss is the answer.
* ``generation_task_with_answers``: ``{"context", "answer", "aliases": [...]}``: greedy generation, cut at
  the example delimiter, must start with the answer or an alias after normalisation.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from smalti.llm.errors import ICLError

TASK_TYPES = ("language_modeling", "multiple_choice", "schema", "generation_task_with_answers")
_REQUIRED = {
    "language_modeling": ("context", "continuation"),
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "generation_task_with_answers": ("context", "answer"),
}
SHIPPED_PREFIX = "smalti-llm:"


@dataclass
class ICLTask:
    """One task: where its examples are and how prompts are built. Keys mirror LLM Foundry's ``icl_tasks``."""

    label: str
    dataset_uri: str
    icl_task_type: str
    num_fewshot: list[int] = field(default_factory=lambda: [0])
    continuation_delimiter: str = " "
    example_delimiter: str = "\n"
    prompt_string: str = ""
    max_seq_len: int | None = None
    batch_size: int = 8
    max_new_tokens: int = 12
    seed: int = 1234
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if self.icl_task_type not in TASK_TYPES:
            raise ICLError(f"task {self.label!r}: icl_task_type={self.icl_task_type!r} is not one of {', '.join(TASK_TYPES)}")
        if isinstance(self.num_fewshot, int):
            self.num_fewshot = [self.num_fewshot]
        self.num_fewshot = [int(n) for n in self.num_fewshot]

    def path(self) -> Path:
        """The task file: ``smalti-llm:<name>`` is a file shipped in ``smalti/llm/assets/icl``."""
        if self.dataset_uri.startswith(SHIPPED_PREFIX):
            return Path(str(resources.files("smalti.llm") / "assets" / "icl" / self.dataset_uri[len(SHIPPED_PREFIX):]))
        return Path(self.dataset_uri).expanduser()

    def examples(self) -> list[dict[str, Any]]:
        """The task's records, checked for the keys its type needs."""
        path = self.path()
        if not path.is_file():
            raise ICLError(f"task {self.label!r}: dataset_uri {self.dataset_uri!r} ({path}) is not a file")
        records = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ICLError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
                missing = [k for k in _REQUIRED[self.icl_task_type] if k not in record]
                if missing:
                    raise ICLError(f"{path}:{lineno} lacks {missing} needed by a {self.icl_task_type} task")
                records.append(record)
        if not records:
            raise ICLError(f"task {self.label!r}: {path} has no examples")
        return records[: self.max_examples] if self.max_examples else records

    def fewshot_prefix(self, records: list[dict[str, Any]], index: int, k: int) -> str:
        """``prompt_string`` then ``k`` solved examples other than ``index`` (seeded per example)."""
        if k == 0:
            return self.prompt_string
        if k >= len(records):
            raise ICLError(f"task {self.label!r}: num_fewshot={k} needs more than {len(records)} examples")
        rng = random.Random(self.seed * 1_000_003 + index)
        others = [i for i in range(len(records)) if i != index]
        shots = rng.sample(others, k)
        return self.prompt_string + "".join(self.solved(records[i]) + self.example_delimiter for i in shots)

    def solved(self, record: dict[str, Any]) -> str:
        """An example with its answer, as shown in few-shot prompts."""
        kind = self.icl_task_type
        d = self.continuation_delimiter
        if kind == "language_modeling":
            return record["context"] + d + record["continuation"]
        if kind == "multiple_choice":
            return record["query"] + d + record["choices"][record["gold"]]
        if kind == "schema":
            return record["context_options"][record["gold"]] + d + record["continuation"]
        return record["context"] + d + record["answer"]


def load_tasks(spec: Any) -> list[ICLTask]:
    """Tasks from a YAML/JSON file path, ``"smalti-llm:default"`` (the shipped set), or a list of mappings."""
    if isinstance(spec, str | os.PathLike):
        text = str(spec)
        if text in ("default", SHIPPED_PREFIX + "default"):
            path = Path(str(resources.files("smalti.llm") / "assets" / "icl" / "tasks.yaml"))
        else:
            path = Path(text).expanduser()
        if not path.is_file():
            raise ICLError(f"ICL task list {text!r} is not a file; give a YAML list of tasks or 'default'")
        from omegaconf import OmegaConf

        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        spec = loaded.get("icl_tasks", loaded) if isinstance(loaded, dict) else loaded
    tasks = []
    for item in spec or []:
        item = dict(item)
        try:
            tasks.append(item if isinstance(item, ICLTask) else ICLTask(**item))
        except TypeError as exc:
            raise ICLError(f"ICL task {item.get('label', item)!r}: {exc}") from exc
    return tasks
