"""The schema of ``smalti-train``'s config: a misspelt key fails before any work starts, naming it.

Component sections (``model``, ``optimizer``, ...) are free-form ``_target_`` dicts checked when they are
built; the ``trainer`` and ``data`` sections have fixed keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class TrainerConfig:
    """Keys of the ``trainer`` section; see :class:`smalti.core.trainer.Trainer` for their meaning."""

    max_duration: str = "200ba"
    eval_interval: Any = "1ep"
    eval_subset_num_batches: int = -1
    device_train_microbatch_size: Any = None
    precision: str = "fp32"
    seed: int = 17
    compile: bool = False
    device: Any = None
    deterministic: bool = False
    log_interval: Any = None
    optimizer_in_backward: bool = False
    cpu_malloc_mmap_threshold: Any = 1048576
    cpu_gemm: str = "auto"


@dataclass
class DataConfig:
    """Keys of the ``data`` section: datasets (or dataloaders) to build and how to batch them."""

    train: Any = None
    eval: Any = None
    global_train_batch_size: int = 32
    eval_batch_size: int = 32
    num_workers: int = 0
    shuffle: bool = True
    drop_last: bool = True


@dataclass
class RunConfig:
    """The whole run: every config group plus ``trainer`` and ``run_name``."""

    run_name: str = "smalti-run"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    parallelism: Any = None
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    algorithms: dict[str, Any] = field(default_factory=dict)
    checkpoint: Any = None
    health: dict[str, Any] = field(default_factory=dict)
    experiment: Any = None


def register_configs(store: ConfigStore | None = None) -> None:
    """Put the schema in Hydra's ConfigStore as ``smalti_train_schema``."""
    from smalti.core.config.hydra_errors import install as list_options_in_errors
    from smalti.core.run_name import register_resolvers

    register_resolvers()
    list_options_in_errors()
    (store or ConfigStore.instance()).store(name="smalti_train_schema", node=RunConfig)
