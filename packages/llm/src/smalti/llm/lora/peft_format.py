"""LoRA adapters in PEFT's folder format: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's
tensor names (``base_model.model.<module path>.lora_A.weight``), for Llama, Mistral and Qwen2 shaped models and
the MoE families whose experts transformers fuses under ``mlp.experts`` (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE).

smalti's fused ``wqkv`` adapter parts ``q``/``k``/``v`` are PEFT's ``q_proj``/``k_proj``/``v_proj`` adapters;
``modules_to_save`` are written whole under their module's name, as PEFT does. Per-expert adapters are PEFT's
``target_parameters`` ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (its ``ParamWrapper``): ``lora_A
[r * E, in]`` holds expert ``e``'s rows at ``e * r ..``, ``lora_B [out, r * E]`` its columns at ``j * E + e``; with
both adapted PEFT nests the wrappers and names the inner one (``gate_up_proj``) ``experts.base_layer.lora_A``. A folder is written under a
temporary name and renamed into place, so a half-written adapter is never seen as complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smalti.llm.errors import LoRAError
from smalti.llm.lora.config import EXPERT_TARGETS, LoRAConfig
from smalti.llm.lora.experts import LoRAExperts, expert_lora_layers
from smalti.llm.lora.layer import lora_layers
from smalti.llm.lora.naming import clean_name

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
#: smalti module (inside a block) and part -> the Hugging Face module (inside a decoder layer).
_HF_MODULES = {
    ("attn.wqkv", "q"): "self_attn.q_proj", ("attn.wqkv", "k"): "self_attn.k_proj",
    ("attn.wqkv", "v"): "self_attn.v_proj", ("attn.out_proj", "o"): "self_attn.o_proj",
    ("ffn.gate_proj", "gate"): "mlp.gate_proj", ("ffn.up_proj", "up"): "mlp.up_proj",
    ("ffn.down_proj", "down"): "mlp.down_proj",
}
_HF_SAVED = {"wte": "model.embed_tokens", "lm_head": "lm_head"}
#: smalti-moe's stacked expert weight -> transformers' fused expert parameter (inside ``mlp.experts``).
_HF_EXPERT_PARAMS = {"w1": "gate_up_proj", "w2": "down_proj"}
_EXPERTS_MODULE = "mlp.experts"
#: adapter_config.json settings smalti's LoRA does not implement, with the value that it does.
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False, "rank_pattern": {},
                "alpha_pattern": {}, "layers_to_transform": None, "use_qalora": False, "trainable_token_indices": None}


def _hf_module(path: str, part: str) -> str:
    """``blocks.3.attn.wqkv`` + ``q`` -> ``model.layers.3.self_attn.q_proj``."""
    head, index, inner = path.split(".", 2)
    if head != "blocks" or (inner, part) not in _HF_MODULES:
        raise LoRAError(f"the LoRA layer {path} ({part}) has no Hugging Face counterpart")
    return f"model.layers.{index}.{_HF_MODULES[(inner, part)]}"


def _expert_keys(path: str, layer: LoRAExperts) -> dict[str, str]:
    """``{w1, w2}`` adapted on the MoE layer at ``path`` -> the PEFT module prefix of its ``lora_A``/``lora_B``."""
    head, index, _ = path.split(".", 2)
    if head != "blocks":
        raise LoRAError(f"the expert LoRA layer {path} has no Hugging Face counterpart")
    module = f"{PREFIX}model.layers.{index}.{_EXPERTS_MODULE}"
    nested = len(layer.adapters.lora_A) > 1  # PEFT wraps gate_up_proj first, so it is the inner (base_layer) one
    return {name: f"{module}.base_layer" if nested and name == "w1" else module for name in layer.adapters.lora_A}


def experts_to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """smalti's ``A [E, r, in]``, ``B [E, out, r]`` -> PEFT's ``lora_A [r * E, in]``, ``lora_B [out, r * E]``."""
    experts, r, fan_in = a.shape
    return a.reshape(experts * r, fan_in), b.permute(1, 2, 0).reshape(b.shape[1], r * experts)


def experts_from_peft(a: torch.Tensor, b: torch.Tensor, experts: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A [r * E, in]``, ``lora_B [out, r * E]`` of ``experts`` experts -> smalti's ``A``, ``B``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % experts or b.shape[1] != a.shape[0]:
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not rank-r adapters of "
                        f"{experts} experts (lora_A [r * {experts}, in], lora_B [out, r * {experts}])")
    r = a.shape[0] // experts
    return a.reshape(experts, r, a.shape[1]), b.reshape(b.shape[0], r, experts).permute(2, 0, 1)


def adapter_tensors(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapters (and ``modules_to_save``) of ``model`` under PEFT's names, fp32 CPU tensors.

    ``state``: whole tensors of ``model`` by name (e.g. gathered from FSDP shards); default ``model``'s own.
    """
    config: LoRAConfig = model.lora_config
    if state is None:
        state = {clean_name(k): v.detach() for k, v in model.state_dict().items()}
    out = {}
    for path, layer in lora_layers(model).items():
        for name in layer.lora_A:
            module = PREFIX + _hf_module(path, name)
            out[f"{module}.lora_A.weight"] = state[f"{path}.lora_A.{name}"].float().cpu().contiguous()
            out[f"{module}.lora_B.weight"] = state[f"{path}.lora_B.{name}"].float().cpu().contiguous()
    for path, layer in expert_lora_layers(model).items():
        for name, module in _expert_keys(path, layer).items():
            a, b = experts_to_peft(state[f"{path}.adapters.lora_A.{name}"], state[f"{path}.adapters.lora_B.{name}"])
            out[f"{module}.lora_A.weight"] = a.float().cpu().contiguous()
            out[f"{module}.lora_B.weight"] = b.float().cpu().contiguous()
    for name in config.modules_to_save:
        out[f"{PREFIX}{_HF_SAVED[name]}.weight"] = state[f"{name}.weight"].float().cpu().contiguous()
    return out


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT reads for ``model``'s adapters."""
    config: LoRAConfig = model.lora_config
    targets = sorted({_HF_MODULES[(p.split(".", 2)[2], n)].split(".")[-1]
                      for p, layer in lora_layers(model).items() for n in layer.lora_A})
    parameters = sorted({f"{_EXPERTS_MODULE}.{_HF_EXPERT_PARAMS[n]}"
                         for layer in expert_lora_layers(model).values() for n in layer.adapters.lora_A})
    source = getattr(model, "hf_folder", None)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(source) if source else None,
        "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "use_rslora": config.rslora,
        "target_modules": targets, "modules_to_save": [_HF_SAVED[m].split(".")[-1] for m in config.modules_to_save] or None,
        "init_lora_weights": True, "inference_mode": True, **_UNSUPPORTED,
        **({"target_parameters": parameters} if parameters else {}),
    }


def save_adapter(model: nn.Module, folder: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model``'s adapters to ``folder`` in PEFT's format (atomically); returns the folder."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(adapter_tensors(model, state), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(model), indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_adapter_config(folder: str | os.PathLike) -> dict[str, Any]:
    """A PEFT LoRA folder's ``adapter_config.json``, checked for what smalti implements."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LoRAError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if cfg.get("peft_type") != "LORA":
        raise LoRAError(f"{path}: peft_type={cfg.get('peft_type')!r}; smalti reads LORA adapters only")
    for key, plain in _UNSUPPORTED.items():
        if cfg.get(key, plain) not in (plain, None) and not (plain == {} and not cfg.get(key)):
            raise LoRAError(f"{path}: {key}={cfg[key]!r} is not supported by smalti's LoRA (it needs {plain!r})")
    return cfg


def lora_settings(folder: str | os.PathLike) -> dict[str, Any]:
    """``model.lora`` settings equal to a PEFT folder's (r, alpha, dropout, rslora, targets, modules_to_save)."""
    cfg = read_adapter_config(folder)
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    short = {n.split(".")[-1] for n in names}
    by_param = {f"{_EXPERTS_MODULE}.{p}": t for t, w in EXPERT_TARGETS.items() for p in [_HF_EXPERT_PARAMS[w]]}
    for name in cfg.get("target_parameters") or []:
        if name not in by_param:
            raise LoRAError(f"{Path(folder) / CONFIG_FILE}: target_parameters names {name!r}; smalti adapts "
                            f"{', '.join(by_param)}")
        short.add(by_param[name])
    return {"r": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg.get("lora_dropout", 0.0),
            "rslora": bool(cfg.get("use_rslora", False)), "targets": sorted(short),
            "modules_to_save": list(cfg.get("modules_to_save") or [])}


@torch.no_grad()
def load_adapter(model: nn.Module, folder: str | os.PathLike) -> None:
    """Fill ``model``'s adapters (and ``modules_to_save``) from a PEFT folder. Its rank, alpha, rsLoRA choice and
    adapted layers must be ``model.lora``'s; anything else is an error naming the setting to change."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(folder)
    config: LoRAConfig = model.lora_config
    path = Path(folder) / CONFIG_FILE
    theirs = {"r": cfg.get("r"), "alpha": cfg.get("lora_alpha"), "rslora": bool(cfg.get("use_rslora", False))}
    for key, value in theirs.items():
        if float(getattr(config, key)) != float(value):
            raise LoRAError(f"{path}: {key}={value!r} but model.lora.{key}={getattr(config, key)!r}; set "
                            f"model.lora.{key}={value} to start from this adapter")
    weights = Path(folder) / WEIGHTS_FILE
    if not weights.is_file():
        raise LoRAError(f"{folder} has no {WEIGHTS_FILE} (adapter_model.bin is not read: re-save with safetensors)")
    tensors = load_file(str(weights))
    params = dict(model.named_parameters())
    params = {clean_name(k): v for k, v in params.items()}
    wanted = {}
    for path_, layer in lora_layers(model).items():
        for name in layer.lora_A:
            module = PREFIX + _hf_module(path_, name)
            wanted[f"{module}.lora_A.weight"] = f"{path_}.lora_A.{name}"
            wanted[f"{module}.lora_B.weight"] = f"{path_}.lora_B.{name}"
    for name in config.modules_to_save:
        wanted[f"{PREFIX}{_HF_SAVED[name]}.weight"] = f"{name}.weight"
    experts: dict[str, int] = {}  # PEFT module prefix -> its layer's expert count
    for path_, layer in expert_lora_layers(model).items():
        for name, module in _expert_keys(path_, layer).items():
            experts[module] = layer.num_experts
            wanted[f"{module}.lora_A.weight"] = f"{path_}.adapters.lora_A.{name}"
            wanted[f"{module}.lora_B.weight"] = f"{path_}.adapters.lora_B.{name}"
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise LoRAError(f"{weights} does not fit model.lora (targets={','.join(config.targets)}): missing "
                        f"{missing[:4]}, unexpected {unexpected[:4]}; set model.lora.targets / modules_to_save as "
                        f"the adapter's target_modules / modules_to_save ({cfg.get('target_modules')})")
    for module, count in experts.items():
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = experts_from_peft(
            tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"], count, f"{weights}: {module}")
    for key, name in wanted.items():
        _copy_into(params[name], tensors[key], f"{weights}: {key}")


def _copy_into(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise LoRAError(f"{what} has shape {tuple(value.shape)}, the model's is {tuple(param.shape)}")
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
