"""The evaluation gauntlet: ICL scores folded into category and composite scores, in LLM Foundry's format.

A gauntlet file (YAML, the mapping under an ``eval_gauntlet`` key or on its own) holds::

    weighting: EQUAL                 # or SAMPLE_SZ, LOG_SAMPLE_SZ: a benchmark's weight inside its category
    subtract_random_baseline: true   # score = accuracy - random_baseline
    rescale_accuracy: true           # ... / (1 - random_baseline), so every benchmark tops out at 1.0
    averages:                        # optional; default: one `default_average` over every category
      core_average: [world_knowledge, reading_comprehension]
    categories:
      - name: world_knowledge
        benchmarks:
          - {name: jeopardy, num_fewshot: 3, random_baseline: 0}

Each benchmark is the ICL task whose ``label`` is its name, at its ``num_fewshot``. A category's score is
the weighted mean of its benchmarks' scores (weights 1, the task's example count, or ``max(log2(count), 1)``);
an average is the plain mean of its categories. Unlike Foundry, which drops a category whose benchmark
did not run, a benchmark that names no task fails at start, naming it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smalti.llm.errors import ICLError

WEIGHTINGS = ("EQUAL", "SAMPLE_SZ", "LOG_SAMPLE_SZ")
#: The gauntlet over the shipped ICL tasks.
SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "icl" / "gauntlet.yaml"
#: Where the scores are logged: ``icl/gauntlet/<category or average>``.
METRIC_PREFIX = "icl/gauntlet/"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of a category: the ICL task ``name`` at ``num_fewshot`` shots, with its chance accuracy."""

    name: str
    num_fewshot: int
    random_baseline: float

    @property
    def metric(self) -> str:
        """The ICL metric this benchmark reads (as :func:`smalti.llm.icl.evaluate.evaluate_tasks` names it)."""
        return f"icl/{self.name}/{self.num_fewshot}shot/accuracy"


@dataclass
class Gauntlet:
    """A parsed gauntlet: its categories, weighting, baseline handling and named averages."""

    categories: dict[str, list[Benchmark]]
    weighting: str = "EQUAL"
    subtract_random_baseline: bool = True
    rescale_accuracy: bool = True
    averages: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ICLError(f"gauntlet weighting={self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if self.rescale_accuracy and not self.subtract_random_baseline:
            raise ICLError("gauntlet rescale_accuracy=true needs subtract_random_baseline=true (the rescaling "
                           "divides the accuracy above chance by the room above chance)")
        if not self.averages:
            self.averages = {"default_average": list(self.categories)}
        for name, members in self.averages.items():
            if name in self.categories:
                raise ICLError(f"gauntlet average {name!r} has the name of a category; give it another")
            unknown = [m for m in members if m not in self.categories]
            if unknown:
                raise ICLError(f"gauntlet average {name!r} names categories that do not exist: {unknown}")

    def check_tasks(self, available: dict[str, list[int]]) -> None:
        """Fail, naming the benchmark, when one has no ICL task (``label -> num_fewshot list``) to score it."""
        for category, benchmarks in self.categories.items():
            for bench in benchmarks:
                if bench.num_fewshot not in available.get(bench.name, []):
                    raise ICLError(
                        f"gauntlet category {category!r}: benchmark {bench.name!r} at {bench.num_fewshot} shots has "
                        f"no ICL task (tasks: {', '.join(f'{k} {v}' for k, v in available.items()) or 'none'}); "
                        "add the task or drop the benchmark"
                    )

    def weight(self, bench: Benchmark, sizes: dict[str, int]) -> float:
        """The benchmark's weight in its category under :attr:`weighting` (``sizes``: examples per task)."""
        if self.weighting == "EQUAL":
            return 1.0
        count = max(sizes.get(bench.name, 1), 1)
        return float(count) if self.weighting == "SAMPLE_SZ" else max(math.log2(count), 1.0)

    def score(self, bench: Benchmark, accuracy: float) -> float:
        """One benchmark's score from its accuracy."""
        if self.subtract_random_baseline:
            accuracy -= bench.random_baseline
            if self.rescale_accuracy:
                accuracy /= 1.0 - bench.random_baseline
        return accuracy

    def scores(self, results: dict[str, float], sizes: dict[str, int]) -> dict[str, float]:
        """Category and average scores from ICL ``results``, as ``icl/gauntlet/<name>`` metrics."""
        categories: dict[str, float] = {}
        for category, benchmarks in self.categories.items():
            missing = [b.metric for b in benchmarks if b.metric not in results]
            if missing:
                raise ICLError(f"gauntlet category {category!r}: no result for {missing}")
            weights = [self.weight(b, sizes) for b in benchmarks]
            categories[category] = sum(w * self.score(b, results[b.metric]) for w, b in zip(weights, benchmarks)) \
                / sum(weights)
        averages = {name: sum(categories[m] for m in members) / len(members) if members else 0.0
                    for name, members in self.averages.items()}
        return {METRIC_PREFIX + name: value for name, value in {**categories, **averages}.items()}


def load_gauntlet(spec: Any) -> Gauntlet:
    """A :class:`Gauntlet` from a YAML file path (``"default"``: the one over the shipped tasks), a mapping
    (Foundry's ``eval_gauntlet`` keys) or itself."""
    if isinstance(spec, Gauntlet):
        return spec
    source = "gauntlet"
    if isinstance(spec, str | os.PathLike):
        path = SHIPPED if str(spec) == "default" else Path(spec).expanduser()
        if not path.is_file():
            raise ICLError(f"gauntlet file {str(spec)!r} is not a file")
        from omegaconf import OmegaConf

        source = str(path)
        spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    elif spec is not None and not isinstance(spec, dict):
        from omegaconf import OmegaConf

        spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    if not isinstance(spec, dict):
        raise ICLError(f"{source}: expected a mapping with `categories`, got {type(spec).__name__}")
    spec = spec.get("eval_gauntlet", spec)
    unknown = set(spec) - {"weighting", "subtract_random_baseline", "rescale_accuracy", "averages", "categories"}
    if unknown:
        raise ICLError(f"{source}: unknown gauntlet keys {sorted(unknown)}")
    categories: dict[str, list[Benchmark]] = {}
    for i, category in enumerate(spec.get("categories") or []):
        name = category.get("name") if isinstance(category, dict) else None
        if not name or not category.get("benchmarks"):
            raise ICLError(f"{source}: category {i} needs a `name` and a list of `benchmarks`")
        try:
            categories[name] = [Benchmark(str(b["name"]), int(b["num_fewshot"]), float(b["random_baseline"]))
                                for b in category["benchmarks"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ICLError(f"{source}: category {name!r}: each benchmark needs `name`, `num_fewshot` and "
                           f"`random_baseline` ({exc!r})") from exc
    if not categories:
        raise ICLError(f"{source}: no categories")
    return Gauntlet(categories, weighting=str(spec.get("weighting", "EQUAL")).upper(),
                    subtract_random_baseline=bool(spec.get("subtract_random_baseline", True)),
                    rescale_accuracy=bool(spec.get("rescale_accuracy", True)),
                    averages={k: list(v) for k, v in (spec.get("averages") or {}).items()})
