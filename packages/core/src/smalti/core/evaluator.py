"""An evaluation set: a labelled dataloader, its metrics and how many batches of it to use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Evaluator:
    """One evaluation dataloader. ``metrics`` are built from the model's ``metrics(train=False)`` when empty."""

    label: str
    dataloader: Any
    subset_num_batches: int = -1
    metrics: dict[str, Any] = field(default_factory=dict)
