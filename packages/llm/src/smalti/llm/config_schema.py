"""smalti-llm's config schemas: models, datasets, the sequence-parallel strategy and the llm callbacks.

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.llm.plugin`; checked by smalti-core after
Hydra composes the run and before anything is built. ``model.moe`` is checked with smalti-moe's schema.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import create_model

from smalti.core.config.types import (
    ExistingPath,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Schema,
    TimeStr,
    ValidationInfo,
    model_validator,
    run_config,
    world_size,
)
from smalti.core.config.validate import field_error
from smalti.llm.model.config import LLMConfig, option_problems
from smalti.llm.model.config import field_names as llm_field_names
from smalti.moe.config_schema import MoESchema

_DTYPES = Literal["float32", "bfloat16", "float16"]


def _sequence_parallel(info: ValidationInfo) -> int:
    parallelism = run_config(info).get("parallelism") or {}
    sp = parallelism.get("sp", 1) if isinstance(parallelism, dict) else 1
    return sp if isinstance(sp, int) and sp > 0 else 1


class LoRASchema(Schema):
    """``model.lora`` (:class:`smalti.llm.lora.LoRAConfig`): adapters on the block linear layers, base frozen."""

    r: PositiveInt = 16
    alpha: PositiveFloat = 32.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    targets: list[str] | str = "all_linear"
    modules_to_save: list[str] | str | None = None
    rslora: bool = False
    base_dtype: Literal["bfloat16", "float32", "nf4"] = "bfloat16"
    init_from: ExistingPath | None = None

    @model_validator(mode="after")
    def _names_known(self) -> LoRASchema:
        from smalti.llm.errors import LoRAError
        from smalti.llm.lora.config import LoRAConfig

        try:
            LoRAConfig.from_any({"targets": self.targets, "modules_to_save": self.modules_to_save})
        except LoRAError as exc:
            key = "modules_to_save" if "modules_to_save" in str(exc) else "targets"
            raise field_error(key, getattr(self, key), str(exc).split(": ", 1)[-1]) from None
        return self


class _LLMRules(Schema):
    """The rules between :class:`~smalti.llm.model.config.LLMConfig`'s fields (the model's own list of them)
    and with ``parallelism.sp``; :data:`LLMSchema` adds the fields."""

    @model_validator(mode="after")
    def _shapes_agree(self, info: ValidationInfo) -> _LLMRules:
        options = {name: getattr(self, name) for name in llm_field_names()}
        for key, value, expected in option_problems(options):
            raise field_error(key, value, expected)
        sp = _sequence_parallel(info)
        if self.n_heads % sp:
            raise field_error("n_heads", self.n_heads, f"a multiple of parallelism.sp={sp} (heads are split over it)")
        return self


def _llm_schema() -> type[Schema]:
    """The schema of :class:`smalti.llm.LLM`'s options, one field per :class:`LLMConfig` field with its type
    (constraints included) and default; the nested ``moe`` and ``lora`` options get their own schemas."""
    hints = typing.get_type_hints(LLMConfig, include_extras=True)
    nested = {"moe": MoESchema | None, "lora": LoRASchema | None}
    fields: dict[str, Any] = {f.name: (nested.get(f.name, hints[f.name]), f.default)
                              for f in dataclasses.fields(LLMConfig)}
    return create_model("LLMSchema", __base__=_LLMRules, __module__=__name__,
                        __doc__=":class:`smalti.llm.LLM`'s options (derived from :class:`LLMConfig`) and the rules "
                                "between them (and ``parallelism.sp``).", **fields)


#: :class:`smalti.llm.LLM`'s options, derived field by field from :class:`~smalti.llm.model.config.LLMConfig`.
LLMSchema = _llm_schema()


class PretrainedLLMSchema(Schema):
    """:class:`smalti.llm.hf.PretrainedLLM` (``model=hf``): a local folder written by ``save_pretrained``."""

    pretrained: ExistingPath
    max_seq_len: PositiveInt | None = None
    require_tokenizer: bool = True
    lora: LoRASchema | None = None


class SequenceParallelSchema(Schema):
    """:class:`smalti.llm.parallelism.SequenceParallelFSDP` (``parallelism=fsdp_sp``)."""

    sp: PositiveInt = 1
    param_dtype: _DTYPES | None = None
    reduce_dtype: _DTYPES | None = None
    reduce_every_microbatch: bool = True

    @model_validator(mode="after")
    def _divides_world(self, info: ValidationInfo) -> SequenceParallelSchema:
        world = world_size(info)
        if world > 1 and world % self.sp:
            raise field_error("sp", self.sp, f"a divisor of the world size {world}")
        return self


class ExpertParallelSchema(Schema):
    """:class:`smalti.llm.parallelism.ExpertParallelFSDP` (``parallelism=fsdp_ep``)."""

    ep: PositiveInt = 1
    param_dtype: _DTYPES | None = None
    reduce_dtype: _DTYPES | None = None
    reduce_every_microbatch: bool = True

    @model_validator(mode="after")
    def _divides_world(self, info: ValidationInfo) -> ExpertParallelSchema:
        world = world_size(info)
        if world > 1 and world % self.ep:
            raise field_error("ep", self.ep, f"a divisor of the world size {world}")
        return self


class TextSchema(Schema):
    """Token datasets built from text: ``TokenizedText``, and the base of the finetuning datasets' schemas."""

    max_seq_len: PositiveInt = 128
    eval_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    packing: bool = True


class FinetuneTextSchema(TextSchema):
    """``FinetuneDataset``'s options (prompt/response rows are longer than pretraining text by default)."""

    max_seq_len: PositiveInt = 256


class ChatSchema(TextSchema):
    """``ChatDataset``'s options."""

    max_seq_len: PositiveInt = 2048
    overlong: Literal["truncate", "drop"] = "truncate"


class MarkovSchema(Schema):
    vocab_size: Annotated[int, Field(ge=2)] = 64
    branching: PositiveInt = 4
    max_seq_len: PositiveInt = 64
    num_samples: PositiveInt = 2048
    concentration: PositiveFloat = 1.0
    seed: NonNegativeInt = 0


class PreparedTextSchema(Schema):
    """``PreparedTextMDS`` (``data=text_mds``); the folder itself is checked when the dataset is built."""

    max_seq_len: PositiveInt = 2048
    replication: PositiveInt | None = None


class HFExportSchema(Schema):
    dtype: _DTYPES | None = None
    merge: bool = True
    max_shard_size: Annotated[int, Field(gt=0)] | Annotated[str, Field(pattern=r"(?i)^\s*[0-9.]+\s*(b|kb|mb|gb|tb)?\s*$")] = "2GB"


class ICLSchema(Schema):
    interval: TimeStr | None = "500ba"
    at_fit_end: bool = True


class MLflowModelSchema(Schema):
    dtype: _DTYPES = "float32"
    interval: PositiveInt | None = None


def schemas() -> dict[str, Any]:
    """What smalti-llm's ``smalti_config_schemas`` hook returns."""
    return {
        "smalti.llm.LLM": LLMSchema,
        "smalti.llm.model.transformer.LLM": LLMSchema,
        "smalti.llm.hf.PretrainedLLM": PretrainedLLMSchema,
        "smalti.llm.parallelism.SequenceParallelFSDP": SequenceParallelSchema,
        "smalti.llm.parallelism.ExpertParallelFSDP": ExpertParallelSchema,
        "smalti.llm.data.text.TokenizedText": TextSchema,
        "smalti.llm.data.finetune.FinetuneDataset": FinetuneTextSchema,
        "smalti.llm.data.chat.ChatDataset": ChatSchema,
        "smalti.llm.data.synthetic.MarkovTokens": MarkovSchema,
        "smalti.llm.data.prepare.PreparedTextMDS": PreparedTextSchema,
        "smalti.llm.hf.HFExport": HFExportSchema,
        "smalti.llm.hf_export.HFExport": HFExportSchema,  # run configs saved before smalti.llm.hf
        "smalti.llm.icl.callback.ICLEval": ICLSchema,
        "smalti.llm.icl.callback.GauntletEval": ICLSchema,
        "smalti.llm.mlflow_registry.MLflowModelRegistry": MLflowModelSchema,
    }


__all__ = ["LLMSchema", "schemas"]
