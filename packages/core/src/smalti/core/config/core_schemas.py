"""smalti-core's config schemas: the ``trainer`` and ``data`` sections and core's own components.

Returned by core's ``smalti_config_schemas`` hook (:mod:`smalti.core.plugin`). A component's schema is read
off its constructor (types, constraints and defaults are written there once); only rules that span keys are
written here. The ``trainer`` section's defaults are the Trainer's, the ``data`` section's are
:class:`~smalti.core.config.schema.DataConfig`'s (the CLI's structured config).
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, create_model, model_validator

from smalti.core.config.derive import schema_for
from smalti.core.config.schema import DataConfig, TrainerConfig
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


def _trainer_schema() -> type[Schema]:
    """The ``trainer`` section: the section's keys of :class:`~smalti.core.trainer.Trainer`, their defaults read
    off its signature (``max_duration``, which the Trainer requires, defaults to the CLI's ``TrainerConfig``)."""
    import inspect

    # Imported by name, as the components below are: the trainer's plugin module asks for these schemas.
    Trainer = importlib.import_module("smalti.core.trainer").Trainer  # noqa: N806

    section = set(TrainerConfig.__dataclass_fields__)
    others = [key for key in inspect.signature(Trainer).parameters if key not in section]
    checks = {
        "max_duration": Annotated[TimeStr, AfterValidator(_not_dur)],
        "eval_interval": TimeOrBatches | None,
        "eval_subset_num_batches": Annotated[int, Field(ge=-1)],
        "device_train_microbatch_size": PositiveInt | Literal["auto"] | None,
        "precision": Literal[PRECISIONS],  # type: ignore[valid-type]
        "seed": NonNegativeInt,
        "device": Annotated[str, AfterValidator(_device)] | None,
        "log_interval": TimeOrBatches | None,
    }
    derived = schema_for(Trainer, checks=checks, exclude=others, name="TrainerSchema")
    return create_model("TrainerSchema", __base__=derived, __module__=__name__,
                        max_duration=(checks["max_duration"], TrainerConfig.max_duration))


def data_parallel_size(config: dict[str, Any], world: int) -> int:
    """Ranks that read different data: the world size divided by the sequence-parallel group (``parallelism.sp``)."""
    parallelism = config.get("parallelism") or {}
    sp = parallelism.get("sp", 1) if isinstance(parallelism, dict) else 1
    return world // sp if isinstance(sp, int) and sp > 0 and world % sp == 0 else world


class _DataRules(Schema):
    """The ``data`` section's rule across keys: batch sizes divide over the data-parallel ranks."""

    @model_validator(mode="after")
    def _divides_over_ranks(self, info: ValidationInfo) -> Schema:
        dp = data_parallel_size(run_config(info), world_size(info))
        for key in ("global_train_batch_size", "eval_batch_size"):
            value = getattr(self, key)
            if key == "eval_batch_size" and not run_config(info).get("data", {}).get("eval"):
                continue
            if value % dp:
                raise field_error(key, value, f"a multiple of the {dp} data-parallel ranks")
        return self


#: The ``data`` section (:class:`~smalti.core.config.schema.DataConfig`, its keys and defaults): batch sizes
#: (global, split over the data-parallel ranks) and loader options; the datasets are built from their nodes.
DataSchema = schema_for(
    DataConfig,
    checks={"global_train_batch_size": PositiveInt, "eval_batch_size": PositiveInt, "num_workers": NonNegativeInt},
    exclude=("train", "eval"),
    base=_DataRules,
    name="DataSchema",
)


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

    found: dict[str, type] = {"trainer": _trainer_schema(), "data": DataSchema}
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
