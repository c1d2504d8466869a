"""LoRA adapters in PEFT's folder format: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's
tensor names (``base_model.model.<module path>.lora_A.weight``) for the model's Hugging Face family: each family
module in :mod:`smalti.llm.hf` names the ``transformers`` module of every adapted part
(:meth:`~smalti.llm.hf.family.Family.adapter_site`, read from its weight names) and of its fused experts.

An adapted part that is a whole ``transformers`` linear module (Llama's ``q_proj``) is PEFT's adapter on it. Parts
fused into one module (DBRX's and MPT's ``Wqkv``, GPT-2's ``c_attn``) are written as one adapter of rank
``n * r`` on it (``n`` adapted parts: ``lora_A`` stacks theirs, ``lora_B`` is block-diagonal, zero on the rows of
parts not adapted) with ``rank_pattern`` / ``alpha_pattern`` keeping the update's scale; read back, such an
adapter splits into the parts, and a plain rank-``r`` PEFT adapter on the fused module gives each part its
``lora_B`` rows and a copy of ``lora_A`` (the same update). GPT-2's ``Conv1D`` modules set ``fan_in_fan_out``.
``modules_to_save`` are written whole under their module's name, as PEFT does.

Per-expert adapters are PEFT's ``target_parameters`` ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``
(its ``ParamWrapper``): ``lora_A [r * E, in]`` holds expert ``e``'s rows at ``e * r ..``, ``lora_B [out, r * E]``
its columns at ``j * E + e``; with both adapted PEFT nests the wrappers and names the inner one (``gate_up_proj``)
``experts.base_layer.lora_A``. A family PEFT cannot hold expert adapters for (DBRX: see
:attr:`~smalti.llm.hf.family.Family.expert_lora_refusal`) refuses the whole export with the reason rather than
write an adapter that is not the trained model. A folder is written under a temporary name and renamed into
place, so a half-written adapter is never seen as complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smalti.llm.errors import ConversionError, LoRAError
from smalti.llm.lora.config import EXPERT_TARGETS, LoRAConfig
from smalti.llm.lora.experts import LoRAExperts, expert_lora_layers
from smalti.llm.lora.layer import lora_layers
from smalti.llm.lora.naming import clean_name
from smalti.llm.lora.sites import block_linears

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
#: smalti-moe's stacked expert weight -> transformers' fused expert parameter (inside ``mlp.experts``).
_HF_EXPERT_PARAMS = {"w1": "gate_up_proj", "w2": "down_proj"}
_EXPERTS_MODULE = "mlp.experts"
#: adapter_config.json settings smalti's LoRA does not implement, with the value that it does.
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "layers_to_transform": None,
                "use_qalora": False, "trainable_token_indices": None}


@dataclass
class _Module:
    """One ``transformers`` linear module and the smalti LoRA parts inside it."""

    name: str
    rows: int
    fan_in_fan_out: bool
    #: every smalti part in it: (layer path, part name, first row, stop row), rows within the module
    parts: list[tuple[str, str, int, int]] = field(default_factory=list)
    #: the adapted ones, in the order their ``lora_A`` rows stack
    adapted: list[tuple[str, str, int, int]] = field(default_factory=list)


def _family(model: nn.Module) -> Any:
    from smalti.llm.hf.registry import family_of

    try:
        return family_of(model.config)
    except ConversionError as exc:
        raise LoRAError(f"the adapters cannot be written or read in PEFT's format: {exc}") from exc


def _modules(model: nn.Module, family: Any) -> dict[str, _Module]:
    """The ``transformers`` modules holding ``model``'s LoRA layers, by module path."""
    parts = family.weight_parts(model.config)
    out: dict[str, _Module] = {}
    for path, layer in lora_layers(model).items():
        for name, a, b in layer.parts:
            try:
                site = family.adapter_site(parts, f"{path}.weight", a, b)
            except ConversionError as exc:
                if name in layer.lora_A:
                    raise LoRAError(f"the LoRA part {name} of {path}: {exc}") from exc
                continue
            module = out.setdefault(site.module, _Module(site.module, site.rows, site.fan_in_fan_out))
            module.parts.append((path, name, site.start, site.stop))
            if name in layer.lora_A:
                module.adapted.append((path, name, site.start, site.stop))
    return {k: m for k, m in out.items() if m.adapted}


def _suffixes(model: nn.Module, family: Any, modules: dict[str, _Module]) -> dict[str, str]:
    """Module path -> the name ``target_modules`` gives it: its last segment, or more of its path when a module
    not adapted ends the same (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``)."""
    parts = family.weight_parts(model.config)
    every = set()
    for path, layer in lora_layers(model).items():
        for _, a, b in layer.parts:
            try:
                every.add(family.adapter_site(parts, f"{path}.weight", a, b).module)
            except ConversionError:
                continue
    out = {}
    for name in modules:
        segments = name.split(".")
        for n in range(1, len(segments) + 1):
            suffix = ".".join(segments[-n:])
            if not any(o.endswith("." + suffix) or o == suffix for o in every - set(modules)):
                break
        out[name] = suffix
    return out


def _expert_keys(path: str, layer: LoRAExperts, family: Any) -> dict[str, str]:
    """``{w1, w2}`` adapted on the MoE layer at ``path`` -> the PEFT module prefix of its ``lora_A``/``lora_B``."""
    head, index, _ = path.split(".", 2)
    if head != "blocks":
        raise LoRAError(f"the expert LoRA layer {path} has no Hugging Face counterpart")
    try:
        module = PREFIX + family.expert_adapter_module(int(index))
    except ConversionError as exc:
        raise LoRAError(f"{exc}; train without the expert targets (model.lora.targets) to export an adapter") from exc
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
    """The adapters (and ``modules_to_save``) of ``model`` under PEFT's names for its family, fp32 CPU tensors.

    ``state``: whole tensors of ``model`` by name (e.g. gathered from FSDP shards); default ``model``'s own.
    """
    config: LoRAConfig = model.lora_config
    family = _family(model)
    if state is None:
        state = {clean_name(k): v.detach() for k, v in model.state_dict().items()}
    out = {}
    for name, module in _modules(model, family).items():
        pieces = [(state[f"{p}.lora_A.{n}"].float().cpu(), state[f"{p}.lora_B.{n}"].float().cpu(), a, b)
                  for p, n, a, b in module.adapted]
        lo_a = torch.cat([piece[0] for piece in pieces])
        lo_b = torch.zeros(module.rows, lo_a.shape[0])
        for j, (_, piece_b, a, b) in enumerate(pieces):  # block-diagonal: part j's rows use its own lora_A rows
            lo_b[a:b, j * config.r:(j + 1) * config.r] = piece_b
        out[f"{PREFIX}{name}.lora_A.weight"] = lo_a.contiguous()
        out[f"{PREFIX}{name}.lora_B.weight"] = lo_b.contiguous()
    for path, layer in expert_lora_layers(model).items():
        for name, module in _expert_keys(path, layer, family).items():
            a, b = experts_to_peft(state[f"{path}.adapters.lora_A.{name}"], state[f"{path}.adapters.lora_B.{name}"])
            out[f"{module}.lora_A.weight"] = a.float().cpu().contiguous()
            out[f"{module}.lora_B.weight"] = b.float().cpu().contiguous()
    saved = _saved_modules(model, family)
    for name in config.modules_to_save:
        out[f"{PREFIX}{saved[name]}.weight"] = state[f"{name}.weight"].float().cpu().contiguous()
    return out


def _saved_modules(model: nn.Module, family: Any) -> dict[str, str]:
    """smalti's ``modules_to_save`` (``wte``, ``lm_head``) -> the family's module path."""
    parts = family.weight_parts(model.config)
    return {name: parts[f"{name}.weight"][0].hf_name.removesuffix(".weight")
            for name in model.lora_config.modules_to_save}


def _fused_alpha(config: LoRAConfig, n: int) -> float:
    """The ``lora_alpha`` of a rank ``n * r`` adapter with the scale of ``config``'s rank-``r`` ones."""
    return config.alpha * (math.sqrt(n) if config.rslora else n)


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT reads for ``model``'s adapters (named for its family)."""
    config: LoRAConfig = model.lora_config
    family = _family(model)
    modules = _modules(model, family)
    suffixes = _suffixes(model, family, modules)
    ranks = {suffixes[k]: len(m.adapted) for k, m in modules.items() if len(m.adapted) > 1}
    parameters = sorted({f"{_EXPERTS_MODULE}.{_HF_EXPERT_PARAMS[n]}"
                         for layer in expert_lora_layers(model).values() for n in layer.adapters.lora_A})
    source = getattr(model, "hf_folder", None)
    saved = _saved_modules(model, family)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(source) if source else None,
        "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "use_rslora": config.rslora,
        "target_modules": sorted(set(suffixes.values())),
        "modules_to_save": [saved[m].split(".")[-1] for m in config.modules_to_save] or None,
        "rank_pattern": {k: n * config.r for k, n in sorted(ranks.items())},
        "alpha_pattern": {k: _fused_alpha(config, n) for k, n in sorted(ranks.items())},
        "fan_in_fan_out": any(m.fan_in_fan_out for m in modules.values()),
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


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` value for ``module`` (a key matches the path or its end)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def lora_settings(folder: str | os.PathLike, base: nn.Module | None = None) -> dict[str, Any]:
    """``model.lora`` settings equal to a PEFT folder's (r, alpha, dropout, rslora, targets, modules_to_save).

    ``base``: a smalti model of the adapter's base (with or without LoRA), whose family names its modules (DBRX's
    ``Wqkv`` is ``q,k,v``); without it the names are read as Llama's (``q_proj`` is ``q``)."""
    cfg = read_adapter_config(folder)
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    short = {n.split(".")[-1] for n in names}
    if base is not None:
        short = set(_targets_of(base, names))
    by_param = {f"{_EXPERTS_MODULE}.{p}": t for t, w in EXPERT_TARGETS.items() for p in [_HF_EXPERT_PARAMS[w]]}
    for name in cfg.get("target_parameters") or []:
        if name not in by_param:
            raise LoRAError(f"{Path(folder) / CONFIG_FILE}: target_parameters names {name!r}; smalti adapts "
                            f"{', '.join(by_param)}")
        short.add(by_param[name])
    return {"r": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg.get("lora_dropout", 0.0),
            "rslora": bool(cfg.get("use_rslora", False)), "targets": sorted(short),
            "modules_to_save": list(cfg.get("modules_to_save") or [])}


def _targets_of(base: nn.Module, names: list[str]) -> list[str]:
    """The smalti targets (``q``, ``o``...) whose parts sit in the ``transformers`` modules PEFT's
    ``target_modules`` ``names`` match on ``base``'s family."""
    family = _family(base)
    parts = family.weight_parts(base.config)
    out = set()
    for path, linears in block_linears(base.blocks[0]).items():
        for name, a, b in linears:
            try:
                module = family.adapter_site(parts, f"blocks.0.{path}.weight", a, b).module
            except ConversionError:
                continue
            if any(re.fullmatch(rf"(.*\.)?(?:{re.escape(n)})", module) for n in names):
                out.add(name)
    return sorted(out)


@torch.no_grad()
def load_adapter(model: nn.Module, folder: str | os.PathLike) -> None:
    """Fill ``model``'s adapters (and ``modules_to_save``) from a PEFT folder made on its family's ``transformers``
    model. Its rank, alpha, rsLoRA choice and adapted layers must be ``model.lora``'s; anything else is an error
    naming the setting to change."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(folder)
    config: LoRAConfig = model.lora_config
    family = _family(model)
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
    params = {clean_name(k): v for k, v in model.named_parameters()}
    modules = _modules(model, family)
    conv1d = any(m.fan_in_fan_out for m in modules.values())
    if modules and bool(cfg.get("fan_in_fan_out", False)) != conv1d:
        raise LoRAError(f"{path}: fan_in_fan_out={cfg.get('fan_in_fan_out')!r} but {family.model_type}'s linear "
                        f"modules are {'Conv1D' if conv1d else 'nn.Linear'} (fan_in_fan_out={conv1d})")
    wanted = {f"{PREFIX}{name}.lora_{x}.weight" for name in modules for x in "AB"}
    saved = _saved_modules(model, family)
    for name in config.modules_to_save:
        wanted.add(f"{PREFIX}{saved[name]}.weight")
    experts: dict[str, tuple[int, str, str]] = {}  # PEFT module prefix -> (expert count, smalti A, smalti B)
    for path_, layer in expert_lora_layers(model).items():
        for name, module in _expert_keys(path_, layer, family).items():
            experts[module] = (layer.num_experts, f"{path_}.adapters.lora_A.{name}", f"{path_}.adapters.lora_B.{name}")
            wanted |= {f"{module}.lora_A.weight", f"{module}.lora_B.weight"}
    missing = sorted(wanted - set(tensors))
    unexpected = sorted(set(tensors) - wanted)
    if missing or unexpected:
        raise LoRAError(f"{weights} does not fit model.lora (targets={','.join(config.targets)}): missing "
                        f"{missing[:4]}, unexpected {unexpected[:4]}; set model.lora.targets / modules_to_save as "
                        f"the adapter's target_modules / modules_to_save ({cfg.get('target_modules')})")
    for name, module in modules.items():
        for target, value in _split_fused(module, cfg, config, tensors, f"{weights}: {name}").items():
            _copy_into(params[target], value, f"{weights}: {name} ({target})")
    for module, (count, a_name, b_name) in experts.items():
        a, b = experts_from_peft(tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"], count,
                                 f"{weights}: {module}")
        _copy_into(params[a_name], a, f"{weights}: {module}.lora_A")
        _copy_into(params[b_name], b, f"{weights}: {module}.lora_B")
    for name in config.modules_to_save:
        key = f"{PREFIX}{saved[name]}.weight"
        _copy_into(params[f"{name}.weight"], tensors[key], f"{weights}: {key}")


def _split_fused(module: _Module, cfg: dict[str, Any], config: LoRAConfig, tensors: dict[str, torch.Tensor],
                 what: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter on ``module`` as smalti's ``lora_A``/``lora_B`` of each adapted part, by parameter name.

    Its update ``scale * B @ A`` is kept exactly: a rank-``r`` adapter gives every part a copy of ``A`` and its
    rows of ``B``; a rank ``n * r`` one (what :func:`adapter_tensors` writes for ``n`` fused parts) must be
    block-diagonal and gives part ``j`` rows ``j * r ..`` of ``A``. ``B`` is rescaled when the module's
    ``rank_pattern`` / ``alpha_pattern`` scale differs from ``model.lora``'s."""
    a = tensors[f"{PREFIX}{module.name}.lora_A.weight"].float()
    b = tensors[f"{PREFIX}{module.name}.lora_B.weight"].float()
    rank = int(_pattern(cfg.get("rank_pattern"), module.name, cfg["r"]))
    alpha = float(_pattern(cfg.get("alpha_pattern"), module.name, cfg["lora_alpha"]))
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape != (module.rows, rank):
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not a rank-{rank} adapter "
                        f"of a module with {module.rows} outputs")
    scale = (alpha / (math.sqrt(rank) if config.rslora else rank)) / config.scaling
    adapted = {(p, n) for p, n, _, _ in module.adapted}
    for p, n, lo, hi in module.parts:
        if (p, n) not in adapted and b[lo:hi].abs().max() > 0:
            raise LoRAError(f"{what} updates the rows of the part {n!r} but model.lora.targets "
                            f"({','.join(config.targets)}) does not adapt it; add {n} to model.lora.targets")
    r, count = config.r, len(module.adapted)
    out = {}
    if rank == r:
        for p, n, lo, hi in module.adapted:
            out[f"{p}.lora_A.{n}"], out[f"{p}.lora_B.{n}"] = a, b[lo:hi] * scale
        return out
    if rank != count * r:
        raise LoRAError(f"{what}: rank {rank} is neither model.lora.r={r} nor {count} x {r} for its {count} "
                        f"adapted parts; set model.lora.r / targets as the adapter was made")
    for j, (p, n, lo, hi) in enumerate(module.adapted):
        cols = slice(j * r, (j + 1) * r)
        rest = torch.cat([b[lo:hi, :cols.start], b[lo:hi, cols.stop:]], dim=1)
        if rest.numel() and rest.abs().max() > 0:
            raise LoRAError(f"{what}: the rank-{rank} adapter mixes the parts' ranks (its lora_B is not "
                            f"block-diagonal over {','.join(x[1] for x in module.adapted)}), which smalti's "
                            "separate q/k/v adapters cannot hold")
        out[f"{p}.lora_A.{n}"], out[f"{p}.lora_B.{n}"] = a[cols], b[lo:hi, cols] * scale
    return out


def _copy_into(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise LoRAError(f"{what} has shape {tuple(value.shape)}, the model's is {tuple(param.shape)}")
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
