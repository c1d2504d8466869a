"""A LoRA run's outputs: the adapters in PEFT's format and, optionally, the base with the adapters merged in as a
plain Hugging Face folder (the ``hf_export`` callback and ``smalti-llm hf export`` call :func:`export_lora`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from smalti.core import distributed
from smalti.llm.lora.apply import merged_state_dict
from smalti.llm.lora.naming import clean_name
from smalti.llm.lora.peft_format import save_adapter
from smalti.llm.model.copies import build_with_weights, full_state_dict, is_sharded

log = logging.getLogger(__name__)


def gathered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole CPU tensors of ``model`` by clean name (all-gathered from FSDP2 shards: collective, every rank calls
    it; ranks other than 0 get ``{}``)."""
    return {clean_name(k): v for k, v in full_state_dict(model).items()}


def merged_model(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A plain fp32 :class:`~smalti.llm.LLM` (no adapters) equal to ``model`` with its adapters merged, carrying
    the Hugging Face source (``hf_folder``, ``hf_config``) of ``model`` when it has one."""
    plain = build_with_weights(model.config, merged_state_dict(model, state), "the merged weights")
    for attr in ("hf_folder", "hf_config"):
        if getattr(model, attr, None) is not None:
            setattr(plain, attr, getattr(model, attr))
    return plain


def export_lora(raw_model: nn.Module, adapter_folder: str | os.PathLike, merged_folder: str | os.PathLike | None,
                shard_model: nn.Module | None = None, dtype: str | None = None,
                max_shard_size: int | str = "2GB") -> tuple[Path, Path | None]:
    """Write ``raw_model``'s adapters to ``adapter_folder`` (PEFT's format) and, unless ``merged_folder`` is None,
    the merged model there as a Hugging Face folder. Collective when ``shard_model`` is FSDP-sharded (rank 0
    writes). Returns both folders."""
    source = shard_model if shard_model is not None else raw_model
    state = gathered_state(source) if is_sharded(source) else None  # FSDP2 shards in place: shard_model is raw_model
    adapter, merged = Path(adapter_folder), Path(merged_folder) if merged_folder is not None else None
    if distributed.get_rank() != 0:
        return adapter, merged
    save_adapter(raw_model, adapter, state)
    log.info("lora: wrote the adapters to %s", adapter)
    if merged is not None:
        from smalti.llm.hf.exporter import export_model

        plain = merged_model(raw_model, state)
        export_model(plain, merged, dtype, max_shard_size)
        log.info("lora: wrote the merged model to %s", merged)
    return adapter, merged
