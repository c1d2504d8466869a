"""smalti-llm's config schemas: models, datasets, the sequence-parallel strategy and the llm callbacks.

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.llm.plugin`; checked by smalti-core after
Hydra composes the run and before anything is built. ``model.moe`` is checked with smalti-moe's schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from smalti.core.config.derive import schema_for
from smalti.core.config.types import (
    ExistingPath,
    Field,
    PositiveFloat,
    PositiveInt,
    Schema,
    ValidationInfo,
    model_validator,
    run_config,
    world_size,
)
from smalti.core.config.validate import field_error
from smalti.llm.choices import EXPORT_DTYPES
from smalti.llm.model.config import LLMConfig, option_problems
from smalti.moe.config_schema import MoESchema


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
            LoRAConfig.from_any({"targets": self.targets, "modules_to_save": self.modules_to_save,
                                 "dropout": self.dropout})
        except LoRAError as exc:
            message = str(exc)
            key = ("modules_to_save" if "modules_to_save" in message
                   else "dropout" if "model.lora.dropout" in message else "targets")
            raise field_error(key, getattr(self, key), str(exc).split(": ", 1)[-1]) from None
        return self


class _LLMRules(Schema):
    """The rules between :class:`~smalti.llm.model.config.LLMConfig`'s fields (the model's own list of them,
    :func:`~smalti.llm.model.config.option_problems`) and with ``parallelism.sp``."""

    @model_validator(mode="after")
    def _shapes_agree(self, info: ValidationInfo) -> _LLMRules:
        defaults = LLMConfig()
        options = {name: getattr(self, name, defaults[name]) for name in defaults}
        for key, value, expected in option_problems(options):
            raise field_error(key, value, expected)
        sp = _sequence_parallel(info)
        if self.n_heads % sp:
            raise field_error("n_heads", self.n_heads, f"a multiple of parallelism.sp={sp} (heads are split over it)")
        return self


#: :class:`smalti.llm.LLM`'s options, read off :class:`~smalti.llm.model.config.LLMConfig`'s fields (types with
#: their constraints, defaults); the nested ``moe`` and ``lora`` options are checked by their own schemas.
LLMSchema = schema_for(LLMConfig, checks={"moe": MoESchema | None, "lora": LoRASchema | None}, base=_LLMRules,
                       name="LLMSchema")


class PretrainedLLMSchema(Schema):
    """:class:`smalti.llm.hf.PretrainedLLM` (``model=hf``): a local folder written by ``save_pretrained``."""

    pretrained: ExistingPath
    max_seq_len: PositiveInt | None = None
    require_tokenizer: bool = True
    lora: LoRASchema | None = None


class _SequenceParallelRules(Schema):
    @model_validator(mode="after")
    def _divides_world(self, info: ValidationInfo) -> _SequenceParallelRules:
        world = world_size(info)
        if world > 1 and world % self.sp:
            raise field_error("sp", self.sp, f"a divisor of the world size {world}")
        return self


class _ExpertParallelRules(Schema):
    @model_validator(mode="after")
    def _divides_world(self, info: ValidationInfo) -> _ExpertParallelRules:
        world = world_size(info)
        if world > 1 and world % self.ep:
            raise field_error("ep", self.ep, f"a divisor of the world size {world}")
        return self


class PreparedTextSchema(Schema):
    """``PreparedTextMDS`` (``data=text_mds``), a factory passing its options on to smalti-streaming's
    ``TextMDS``; the folder itself is checked when the dataset is built."""

    max_seq_len: PositiveInt = 2048
    replication: PositiveInt | None = None


class HFExportSchema(Schema):
    """:class:`smalti.llm.hf.HFExport`, written out: its module loads ``transformers``, which a config check
    must not (``tests/test_schema_defaults.py`` holds the defaults to the constructor's)."""

    dtype: Literal[EXPORT_DTYPES] | None = None  # type: ignore[valid-type]
    merge: bool = True
    max_shard_size: Annotated[int, Field(gt=0)] | Annotated[str, Field(pattern=r"(?i)^\s*[0-9.]+\s*(b|kb|mb|gb|tb)?\s*$")] = "2GB"


def _derived() -> dict[str, type[Schema]]:
    """The schemas read off their components' constructors (:func:`~smalti.core.config.derive.schema_for`),
    by ``_target_``; imported here, when the config check asks, not when the plugin loads."""
    from smalti.llm.data.chat import ChatDataset
    from smalti.llm.data.finetune import FinetuneDataset
    from smalti.llm.data.synthetic import MarkovTokens
    from smalti.llm.data.text import TokenizedText
    from smalti.llm.icl.callback import GauntletEval, ICLEval
    from smalti.llm.mlflow_registry import MLflowModelRegistry
    from smalti.llm.parallelism import ExpertParallelFSDP, SequenceParallelFSDP

    return {
        "smalti.llm.parallelism.SequenceParallelFSDP": schema_for(SequenceParallelFSDP, base=_SequenceParallelRules),
        "smalti.llm.parallelism.ExpertParallelFSDP": schema_for(ExpertParallelFSDP, base=_ExpertParallelRules),
        "smalti.llm.data.text.TokenizedText": schema_for(TokenizedText),
        "smalti.llm.data.finetune.FinetuneDataset": schema_for(FinetuneDataset),
        "smalti.llm.data.chat.ChatDataset": schema_for(ChatDataset),
        "smalti.llm.data.synthetic.MarkovTokens": schema_for(MarkovTokens),
        "smalti.llm.icl.callback.ICLEval": schema_for(ICLEval),
        "smalti.llm.icl.callback.GauntletEval": schema_for(GauntletEval),
        "smalti.llm.mlflow_registry.MLflowModelRegistry": schema_for(MLflowModelRegistry),
    }


def schemas() -> dict[str, Any]:
    """What smalti-llm's ``smalti_config_schemas`` hook returns."""
    return {
        "smalti.llm.LLM": LLMSchema,
        "smalti.llm.model.transformer.LLM": LLMSchema,
        "smalti.llm.hf.PretrainedLLM": PretrainedLLMSchema,
        "smalti.llm.data.prepare.PreparedTextMDS": PreparedTextSchema,
        "smalti.llm.hf.HFExport": HFExportSchema,
        "smalti.llm.hf_export.HFExport": HFExportSchema,  # run configs saved before smalti.llm.hf
        **_derived(),
    }


__all__ = ["LLMSchema", "schemas"]
