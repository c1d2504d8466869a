"""smalti-core's config schemas: the ``trainer`` and ``data`` sections and core's own components.

Returned by core's ``smalti_config_schemas`` hook (:mod:`smalti.core.plugin`). Each schema mirrors the
arguments of the class it checks; arguments without a rule are left to the builder.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from smalti.core.config.types import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
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


class AdamSchema(Schema):
    """``torch.optim.Adam``'s options; the subclasses below carry each Adam variant's own defaults."""

    lr: NonNegativeFloat = 1e-3
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


class AdamWSchema(AdamSchema):
    """``torch.optim.AdamW``'s options."""

    weight_decay: NonNegativeFloat = 1e-2


class DecoupledAdamWSchema(AdamSchema):
    """:class:`smalti.core.optim.DecoupledAdamW`'s options."""

    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    weight_decay: NonNegativeFloat = 1e-5


class SGDSchema(Schema):
    """``torch.optim.SGD`` options."""

    lr: NonNegativeFloat = 1e-3
    momentum: Probability = 0.0
    weight_decay: NonNegativeFloat = 0.0


class WarmupSchedulerSchema(Schema):
    """The warmup schedulers of :mod:`smalti.core.optim.schedulers`."""

    t_warmup: TimeStr = "0ba"
    t_max: TimeStr | None = None
    alpha_f: Probability = 0.0


class DDPSchema(Schema):
    backend: str | None = None
    timeout_s: PositiveFloat = 600
    bucket_cap_mb: PositiveInt = 25


_DTYPE = Literal["float32", "bfloat16", "float16"]


class FSDPSchema(Schema):
    backend: str | None = None
    timeout_s: PositiveFloat = 600
    param_dtype: _DTYPE | None = None
    reduce_dtype: _DTYPE | None = None
    reduce_every_microbatch: bool = True


class HSDPSchema(FSDPSchema):
    replicate: Annotated[int, Field(ge=-1)] = -1
    shard: Annotated[int, Field(ge=-1)] = -1


class EarlyStoppingSchema(Schema):
    monitor: str
    mode: Literal["min", "max"] = "min"
    patience: PositiveInt = 3
    min_delta: NonNegativeFloat = 0.0


class IntervalSchema(Schema):
    """Callbacks with only an ``interval`` (memory and optimizer monitors)."""

    interval: TimeOrBatches = "10ba"


class NaNGuardSchema(Schema):
    action: Literal["stop", "skip"] = "stop"
    max_skips: NonNegativeInt = 10


class ProgressBarSchema(Schema):
    force: bool = False
    refresh_every: PositiveInt = 10


class SpeedMonitorSchema(Schema):
    window_size: PositiveInt = 100
    gpu_flops_available: PositiveFloat | None = None


class EMASchema(Schema):
    half_life: TimeOrBatches | None = "100ba"
    smoothing: Annotated[float, Field(ge=0, lt=1)] | None = None
    update_interval: TimeOrBatches = "1ba"
    ema_start: TimeOrBatches = "0ba"


class GradientClippingSchema(Schema):
    clipping_type: Literal["norm", "value"] = "norm"
    clipping_threshold: PositiveFloat = 1.0
    log_every: TimeOrBatches = "10ba"


class OptimizerMonitorSchema(IntervalSchema):
    per_layer: bool = True


class LossSpikeSchema(Schema):
    action: Literal["log", "save_and_stop", "rollback"] = "log"
    window_size: PositiveInt = 100
    outlier_multiplier: Annotated[float, Field(gt=1)] = 2.0
    patience: NonNegativeInt = 4
    loss_cap: PositiveFloat | None = 10.0
    max_rollbacks: NonNegativeInt = 3
    check_interval: TimeOrBatches = "1ba"


class RuntimeEstimatorSchema(IntervalSchema):
    window_size: PositiveInt = 50
    skip_batches: NonNegativeInt = 1


class ProfilerSchema(Schema):
    wait: NonNegativeInt = 5
    warmup: NonNegativeInt = 1
    active: PositiveInt = 3
    repeat: NonNegativeInt = 1
    skip_first: NonNegativeInt = 0
    profile_memory: bool = False
    record_shapes: bool = False
    with_stack: bool = False
    trace_dir: str | None = None
    gzip_traces: bool = False


class ActivationMonitorSchema(Schema):
    interval: TimeOrBatches = "25ba"
    stats: list[Literal["max", "average", "std", "l2_norm", "kurtosis"]] = ["max", "average", "std"]
    modules: list[str] | None = None
    module_types: list[str] | None = None


class GoodputSchema(Schema):
    path: str | None = None
    flush_interval_s: NonNegativeFloat = 30.0
    started_at: NonNegativeFloat | None = None


#: A time string, or a plain number read as a fraction of the run (``0.5`` is ``0.5dur``).
TimeOrFraction = TimeStr | NonNegativeFloat


class LabelSmoothingSchema(Schema):
    smoothing: Annotated[float, Field(ge=0, lt=1)] = 0.1
    ignore_index: int = -100


class Float8TrainingSchema(Schema):
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    skip: list[str] = ["lm_head", "head", "output", "*router*"]
    fsdp_float8_all_gather: bool = True


class LayerFreezingSchema(Schema):
    freeze_start: TimeOrFraction = "0.5dur"
    freeze_level: Probability = 1.0
    drop_optimizer_state: bool = False


class SeqLengthWarmupSchema(Schema):
    duration: TimeOrFraction = "0.3dur"
    min_seq_length: PositiveInt = 8
    max_seq_length: PositiveInt = 1024
    step_size: PositiveInt = 8
    truncate: bool = True

    @model_validator(mode="after")
    def _lengths(self) -> SeqLengthWarmupSchema:
        if self.min_seq_length > self.max_seq_length:
            raise field_error("min_seq_length", self.min_seq_length,
                              f"at most max_seq_length ({self.max_seq_length})")
        return self


class SAMSchema(Schema):
    rho: PositiveFloat = 0.05
    epsilon: NonNegativeFloat = 1.0e-12
    interval: TimeOrBatches = 1
    log_every: TimeOrBatches = "10ba"


class SWASchema(Schema):
    swa_start: TimeOrBatches = "0.7dur"
    update_interval: TimeOrBatches = "1ep"
    swa_lr: NonNegativeFloat | None = None
    anneal_steps: NonNegativeInt = 10
    anneal_strategy: Literal["cos", "linear"] = "cos"
    swap_at_fit_end: bool = True
    bn_update_batches: NonNegativeInt = 16


class ConsoleLoggerSchema(Schema):
    log_interval: TimeOrBatches = "10ba"


class MLPRegressorSchema(Schema):
    in_features: PositiveInt = 16
    hidden: PositiveInt = 64
    out_features: PositiveInt = 4
    depth: PositiveInt = 2
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0


class TinyLMSchema(Schema):
    vocab_size: PositiveInt = 256
    d_model: PositiveInt = 128
    n_heads: PositiveInt = 4
    n_layers: PositiveInt = 2
    max_seq_len: PositiveInt = 256

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyLMSchema:
        if self.d_model % self.n_heads:
            raise field_error("n_heads", self.n_heads, f"a divisor of model.d_model={self.d_model}")
        return self


class CharCorpusSchema(Schema):
    seq_len: PositiveInt = 64
    split: Literal["train", "eval"] = "train"
    eval_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1


class SyntheticRegressionSchema(Schema):
    num_samples: PositiveInt = 512
    in_features: PositiveInt = 16
    out_features: PositiveInt = 4
    noise: NonNegativeFloat = 0.01


def schemas() -> dict[str, type]:
    """What core's ``smalti_config_schemas`` hook returns."""
    warmups = ("ConstantWithWarmup", "CosineWithWarmup", "InverseSqrtWithWarmup", "LinearWithWarmup")
    return {
        "trainer": TrainerSchema,
        "data": DataSchema,
        "torch.optim.AdamW": AdamWSchema,
        "torch.optim.Adam": AdamSchema,
        "smalti.core.optim.DecoupledAdamW": DecoupledAdamWSchema,
        "torch.optim.SGD": SGDSchema,
        **{f"smalti.core.optim.{name}": WarmupSchedulerSchema for name in warmups},
        "smalti.core.parallelism.DDP": DDPSchema,
        "smalti.core.parallelism.FSDP": FSDPSchema,
        "smalti.core.parallelism.HSDP": HSDPSchema,
        "smalti.core.callbacks.EarlyStopping": EarlyStoppingSchema,
        "smalti.core.callbacks.MemoryMonitor": IntervalSchema,
        "smalti.core.callbacks.NaNGuard": NaNGuardSchema,
        "smalti.core.callbacks.ProgressBar": ProgressBarSchema,
        "smalti.core.callbacks.SpeedMonitor": SpeedMonitorSchema,
        "smalti.core.callbacks.OptimizerMonitor": OptimizerMonitorSchema,
        "smalti.core.callbacks.LossSpike": LossSpikeSchema,
        "smalti.core.callbacks.RuntimeEstimator": RuntimeEstimatorSchema,
        "smalti.core.callbacks.Profiler": ProfilerSchema,
        "smalti.core.callbacks.ActivationMonitor": ActivationMonitorSchema,
        "smalti.core.callbacks.Goodput": GoodputSchema,
        "smalti.core.algorithms.LabelSmoothing": LabelSmoothingSchema,
        "smalti.core.algorithms.LayerFreezing": LayerFreezingSchema,
        "smalti.core.algorithms.Float8Training": Float8TrainingSchema,
        "smalti.core.algorithms.SeqLengthWarmup": SeqLengthWarmupSchema,
        "smalti.core.algorithms.SAM": SAMSchema,
        "smalti.core.algorithms.SWA": SWASchema,
        "smalti.core.algorithms.EMA": EMASchema,
        "smalti.core.algorithms.GradientClipping": GradientClippingSchema,
        "smalti.core.loggers.ConsoleLogger": ConsoleLoggerSchema,
        "smalti.core.examples.MLPRegressor": MLPRegressorSchema,
        "smalti.core.examples.TinyLM": TinyLMSchema,
        "smalti.core.examples.CharCorpus": CharCorpusSchema,
        "smalti.core.examples.SyntheticRegression": SyntheticRegressionSchema,
    }
