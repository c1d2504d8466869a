"""smalti-core's config schemas: the ``trainer`` and ``data`` sections and core's own components.

Returned by core's ``smalti_config_schemas`` hook (:mod:`smalti.core.plugin`). A component's schema is read
off its constructor (types, constraints and defaults are written there once); only rules that span keys are
written here. The two sections are not components, so their schemas are written out.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from smalti.core.config.derive import schema_for
from smalti.core.config.types import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    ProperFraction,
    Schema,
    TimeOrBatches,
    TimeStr,
    ValidationInfo,
    field_error,
    run_config,
    world_size,
)
from smalti.core.precision import PRECISIONS


def _device(value: Any) -> Any:
    import torch

    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError("expected a torch device such as cpu, cuda or cuda:1 (or null: the best available)") from None
    return value


def _not_dur(value: str) -> str:
    if value.strip().endswith("dur"):
        raise ValueError("expected a time in ep, ba, sp or tok (dur is a fraction of this value)")
    return value


class TrainerSchema(Schema):
    """The ``trainer`` section (:class:`smalti.core.trainer.Trainer`'s arguments)."""

    max_duration: Annotated[TimeStr, AfterValidator(_not_dur)] = "200ba"
    eval_interval: TimeOrBatches | None = "1ep"
    eval_subset_num_batches: Annotated[int, Field(ge=-1)] = -1
    device_train_microbatch_size: PositiveInt | Literal["auto"] | None = None
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    seed: NonNegativeInt = 17
    compile: bool = False
    deterministic: bool = False
    device: Annotated[str, AfterValidator(_device)] | None = None
    log_interval: TimeOrBatches | None = None


def data_parallel_size(config: dict[str, Any], world: int) -> int:
    """Ranks that read different data: the world size divided by the sequence-parallel group (``parallelism.sp``)."""
    parallelism = config.get("parallelism") or {}
    sp = parallelism.get("sp", 1) if isinstance(parallelism, dict) else 1
    return world // sp if isinstance(sp, int) and sp > 0 and world % sp == 0 else world


class DataSchema(Schema):
    """The ``data`` section: batch sizes (global, split over the data-parallel ranks) and loader options."""

    global_train_batch_size: PositiveInt = 32
    eval_batch_size: PositiveInt = 32
    num_workers: NonNegativeInt = 0
    shuffle: bool = True
    drop_last: bool = True

    @model_validator(mode="after")
    def _divides_over_ranks(self, info: ValidationInfo) -> DataSchema:
        dp = data_parallel_size(run_config(info), world_size(info))
        for key in ("global_train_batch_size", "eval_batch_size"):
            value = getattr(self, key)
            if key == "eval_batch_size" and not run_config(info).get("data", {}).get("eval"):
                continue
            if value % dp:
                raise field_error(key, value, f"a multiple of the {dp} data-parallel ranks")
        return self


#: Checks for ``torch.optim``'s Adam family, whose signatures (``lr: float | Tensor``) say too little; the
#: defaults are still each optimizer's own.
_ADAM_CHECKS = {"lr": NonNegativeFloat, "betas": tuple[ProperFraction, ProperFraction], "eps": PositiveFloat,
                "weight_decay": NonNegativeFloat}
_SGD_CHECKS = {"lr": NonNegativeFloat, "momentum": Probability, "weight_decay": NonNegativeFloat}


class _SeqLengthRules(Schema):
    @model_validator(mode="after")
    def _lengths(self) -> Schema:
        low, high = getattr(self, "min_seq_length", None), getattr(self, "max_seq_length", None)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            raise field_error("min_seq_length", low, f"at most max_seq_length ({high})")
        return self


class _TinyLMRules(Schema):
    @model_validator(mode="after")
    def _heads_divide_width(self) -> Schema:
        d_model, n_heads = getattr(self, "d_model", None), getattr(self, "n_heads", None)
        if isinstance(d_model, int) and isinstance(n_heads, int) and d_model % n_heads:
            raise field_error("n_heads", n_heads, f"a divisor of model.d_model={d_model}")
        return self


def schemas() -> dict[str, type]:
    """What core's ``smalti_config_schemas`` hook returns: the two sections, and each component's schema read
    off its constructor (:func:`~smalti.core.config.derive.schema_for`)."""
    import torch

    found: dict[str, type] = {"trainer": TrainerSchema, "data": DataSchema}
    for name, checks in (("AdamW", _ADAM_CHECKS), ("Adam", _ADAM_CHECKS), ("SGD", _SGD_CHECKS)):
        found[f"torch.optim.{name}"] = schema_for(getattr(torch.optim, name), checks=checks)
    for package, names in _COMPONENTS.items():
        module = importlib.import_module(package)
        for name in names:
            found[f"{package}.{name}"] = schema_for(getattr(module, name), base=_RULES.get(name, Schema))
    return found


#: Core's components by the package configs name them from (``_target_: smalti.core.callbacks.Profiler``).
_COMPONENTS = {
    "smalti.core.optim": ("DecoupledAdamW", "ConstantWithWarmup", "CosineWithWarmup", "InverseSqrtWithWarmup",
                          "LinearWithWarmup"),
    "smalti.core.parallelism": ("SingleDevice", "DDP", "FSDP", "HSDP"),
    "smalti.core.callbacks": ("EarlyStopping", "MemoryMonitor", "NaNGuard", "ProgressBar", "SpeedMonitor",
                              "OptimizerMonitor", "LossSpike", "RuntimeEstimator", "Profiler", "ActivationMonitor",
                              "Goodput", "LRMonitor"),
    "smalti.core.algorithms": ("LabelSmoothing", "LayerFreezing", "Float8Training", "SeqLengthWarmup", "SAM", "SWA",
                               "EMA", "GradientClipping"),
    "smalti.core.loggers": ("ConsoleLogger", "JSONLLogger", "MLflowLogger", "TensorBoardLogger", "WandBLogger"),
    "smalti.core.examples": ("MLPRegressor", "TinyLM", "CharCorpus", "SyntheticRegression"),
}
#: Rules that span keys, by component name.
_RULES: dict[str, type[Schema]] = {"SeqLengthWarmup": _SeqLengthRules, "TinyLM": _TinyLMRules}
