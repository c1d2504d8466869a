"""Put LoRA adapters on a smalti :class:`~smalti.llm.LLM` (``model.lora``), freeze and shrink its base, fill the
adapters once the base weights are in, and fold them back into plain weights.

The model keeps every base parameter under its usual name (see :class:`LoRALinear`), so building on the meta
device, FSDP2 sharding, the Hugging Face importer and activation checkpointing work as for full finetuning;
only the ``lora_A``/``lora_B`` tensors (and ``modules_to_save``) require gradients, so the optimizer, the
gradients and the checkpoint hold nothing else.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from smalti.llm.errors import LoRAError
from smalti.llm.lora.config import ALL_LINEAR, EXPERT_TARGETS, LoRAConfig
from smalti.llm.lora.experts import LoRAExperts, expert_lora_layers
from smalti.llm.lora.fingerprint import BaseFingerprint
from smalti.llm.lora.layer import LoRALinear, is_nf4, lora_layers
from smalti.llm.lora.naming import clean_name, is_adapter_parameter
from smalti.llm.lora.sites import block_linears

log = logging.getLogger(__name__)

#: QLoRA's NF4 layout: 64 weights share an absmax scale; 256 scales share one double-quantisation constant.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "nf4": torch.bfloat16}


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _upcast_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Keep the residual stream in fp32 when the embedding table is held in bf16."""
    return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output


def _adapt_experts(block: nn.Module, config: LoRAConfig) -> set[str]:
    """Put per-expert adapters on ``block``'s MoE layer (when it has one and experts are targeted); returns the
    expert targets placed."""
    from smalti.moe import MoE

    ffn = getattr(block, "ffn", None)
    layer = getattr(ffn, "moe", None)
    wanted = [t for t in config.targets if t in EXPERT_TARGETS]
    if not wanted or not isinstance(layer, MoE):
        return set()
    weights = [EXPERT_TARGETS[t] for t in wanted]
    ffn.moe = LoRAExperts.adapt(layer, weights, config.r, config.scaling)
    return set(wanted)


def apply_lora(model: nn.Module, lora: Any) -> LoRAConfig:
    """Wrap ``model``'s block linear layers in :class:`LoRALinear`, freeze every base parameter (held in
    ``base_dtype``) and make the adapters and ``modules_to_save`` the only trainable parameters (fp32).

    Works on a model built on the meta device (the usual case) or on a real one; call :func:`finish_lora_init`
    after the base weights are filled (``LLM.init_weights`` does). Returns the checked config.
    """
    config = LoRAConfig.from_any(lora)
    if getattr(model, "lora_config", None) is not None:
        raise LoRAError("the model already has LoRA adapters; apply model.lora once")
    if "lm_head" in config.modules_to_save and getattr(model, "lm_head", None) is None:
        raise LoRAError("model.lora.modules_to_save names lm_head but the model ties it to the embedding: "
                        "train embed_tokens instead")
    wanted = set(config.targets)
    found: set[str] = set()
    for block in model.blocks:
        for path, parts in block_linears(block).items():
            adapted = [name for name, _, _ in parts if name in wanted]
            found.update(adapted)
            base = block.get_submodule(path)
            _set_submodule(block, path, LoRALinear(base, parts, adapted, config.r, config.scaling, config.dropout))
        found.update(_adapt_experts(block, config))
    missing = wanted - found
    if set(ALL_LINEAR) <= wanted:  # all_linear: the linear layers the blocks have (an MoE block has no dense FFN)
        missing -= set(ALL_LINEAR) - {"q", "k", "v", "o"}
    if missing:
        raise LoRAError(f"model.lora.targets names {sorted(missing)} but the model has no such layer (of the "
                        f"targets named it has {sorted(found)}; the expert targets need an MoE model, the gate, up "
                        "and down targets a dense FFN)")
    savable = {name: model.get_submodule(name) for name in config.modules_to_save}
    keep = {id(p) for m in savable.values() for p in m.parameters()}
    dtype = _DTYPES[config.base_dtype]
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if name.startswith("lora_") or isinstance(module, nn.ParameterDict):
                continue
            if id(param) in keep:
                param.requires_grad_(True)
                continue
            if param.dim() >= 2 and param.dtype != dtype:
                param = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                setattr(module, name, param)
            param.requires_grad_(False)
    if dtype != torch.float32 and "wte" not in savable:
        model.wte.register_forward_hook(_upcast_output)
    model.lora_base = BaseFingerprint(device=model.wte.weight.device)
    model.lora_config = config
    return config


@torch.no_grad()
def finish_lora_init(model: nn.Module) -> None:
    """After the base weights are in: start the adapters (PEFT's init, or ``init_from``'s adapter) and, for
    ``base_dtype=nf4``, quantise the frozen linear weights to NF4."""
    config: LoRAConfig = model.lora_config
    model.lora_base.set_from(getattr(model, "hf_folder", None))
    for layer in (*lora_layers(model).values(), *expert_lora_layers(model).values()):
        layer.reset_adapters()
    for name in config.modules_to_save:  # trained in full from the base's values, in fp32
        for p in model.get_submodule(name).parameters():
            if p.dtype != torch.float32:
                p.data = p.data.float()
    if config.init_from:
        from smalti.llm.lora.peft_format import load_adapter

        load_adapter(model, config.init_from)
    if config.base_dtype == "nf4":
        quantize_base(model)


def quantize_base(model: nn.Module) -> None:
    """Replace every frozen linear weight of ``model``'s LoRA layers by torchao's ``NF4Tensor`` (64-value blocks,
    their absmax scales double-quantised to int8 in blocks of 256: QLoRA's format)."""
    try:
        from torchao.quantization import to_nf4
    except ImportError as exc:
        raise LoRAError("model.lora.base_dtype=nf4 needs torchao: pip install 'smalti-llm[qlora]'") from exc
    from torch.distributed.tensor import DTensor

    for path, layer in lora_layers(model).items():
        w = layer.weight
        if is_nf4(w):
            continue
        if isinstance(w, DTensor):
            raise LoRAError("model.lora.base_dtype=nf4 is not supported with a sharded (FSDP) model yet; use "
                            "parallelism=single or base_dtype=bfloat16")
        if w.numel() % NF4_BLOCK:
            raise LoRAError(f"{path}.weight {tuple(w.shape)} does not split into NF4 blocks of {NF4_BLOCK} values; "
                            "use base_dtype=bfloat16")
        # QLoRA's 256 scales per double-quantisation block, or the largest divisor of the block count for small layers
        scaler_block = math.gcd(w.numel() // NF4_BLOCK, NF4_SCALER_BLOCK)
        layer.weight = nn.Parameter(to_nf4(w.detach().to(torch.bfloat16).contiguous(), NF4_BLOCK, scaler_block),
                                    requires_grad=False)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train (adapters and ``modules_to_save``) by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter folded in (``W + scaling * B @ A``), without adapter tensors, in
    fp32: what a plain :class:`~smalti.llm.LLM` of the same config loads.

    ``state``: whole tensors of ``model`` (e.g. gathered from FSDP shards); default ``model``'s own.
    """
    layers = lora_layers(model)
    if state is None:
        state = {clean_name(k): v for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if is_adapter_parameter(key) or key.startswith("lora_base."):
            continue
        out[key] = (value.get_original_weight() if is_nf4(value) else value).float()
    for path, layer in layers.items():
        weight = out[f"{path}.weight"].clone()
        for name, a, b in layer.parts:
            if name in layer.lora_A:
                lo_a, lo_b = state[f"{path}.lora_A.{name}"].float(), state[f"{path}.lora_B.{name}"].float()
                weight[a:b] += (lo_b @ lo_a) * layer.scaling
        out[f"{path}.weight"] = weight
    for path, experts in expert_lora_layers(model).items():
        for name in experts.adapters.lora_A:
            lo_a = state[f"{path}.adapters.lora_A.{name}"].float()
            lo_b = state[f"{path}.adapters.lora_B.{name}"].float()
            out[f"{path}.{name}"] = out[f"{path}.{name}"] + torch.bmm(lo_a.transpose(1, 2), lo_b.transpose(1, 2)) * (
                experts.adapters.scaling)
    return out
