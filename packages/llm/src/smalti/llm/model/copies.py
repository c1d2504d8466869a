"""Whole, unsharded copies of a model's weights, and models built from them (no random init first).

Below the exporters and importers (:mod:`smalti.llm.export`, :mod:`smalti.llm.hf`, :mod:`smalti.llm.lora`), which
all use them, so that none of those has to import another for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smalti.llm.errors import ConversionError
from smalti.llm.model.config import LLMConfig
from smalti.llm.model.transformer import LLM


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards any of ``model``'s tensors (a DTensor among them; FSDP2 shards a model in place)."""
    return any(hasattr(t, "full_tensor") for t in model.state_dict().values())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as whole CPU tensors, also when FSDP2 shards them.

    Collective under FSDP: every rank must call it (only rank 0 gets the tensors; the others get ``{}``).
    """
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def build_with_weights(config: Mapping[str, Any], state: dict[str, torch.Tensor], source: str = "the weights") -> LLM:
    """An :class:`LLM` on the CPU built from ``config`` and filled with ``state`` (no random init first).

    ``config``: a model's :class:`~smalti.llm.model.config.LLMConfig`, of which only the stored options are
    taken (no adapters, checkpointing or init device), or the stored options themselves (an exported folder's)."""
    options = config.architecture() if isinstance(config, LLMConfig) else dict(config)
    model = LLM(**options, init_device="meta")
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConversionError(f"{source} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name not in state:  # non-persistent (e.g. MoE token counters): start from zero
                buf.zero_()
    return model.eval()


def plain_copy(model: LLM, state: dict[str, torch.Tensor] | None = None) -> LLM:
    """An unsharded CPU copy of ``model`` (with ``state`` as its weights: default ``model``'s own)."""
    return build_with_weights(model.config, state if state is not None else full_state_dict(model))
