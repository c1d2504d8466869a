"""``model.lora``: which linear layers get low-rank adapters, their rank and scaling, and how the frozen base
is stored (bf16, fp32 or QLoRA's 4-bit NormalFloat)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from smalti.llm.errors import LoRAError

#: Short target names -> the linear layer (and, for the fused query/key/value projection, the part of it) of a
#: smalti block they name. PEFT's module names (``q_proj``, ``o_proj``, ``gate_proj``...) are accepted too.
TARGETS = {
    "q": ("attn.wqkv", "q"), "k": ("attn.wqkv", "k"), "v": ("attn.wqkv", "v"), "o": ("attn.out_proj", "o"),
    "gate": ("ffn.gate_proj", "gate"), "up": ("ffn.up_proj", "up"), "down": ("ffn.down_proj", "down"),
}
#: What ``all_linear`` means: every linear layer of every block (as PEFT's ``all-linear``: not the output head).
ALL_LINEAR = tuple(TARGETS)
#: Targets on an MoE layer's stacked experts -> its weight (PEFT's ``target_parameters``
#: ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``); ``experts`` names both.
EXPERT_TARGETS = {"experts_gate_up": "w1", "experts_down": "w2"}
_EXPERT_ALIASES = {"experts": tuple(EXPERT_TARGETS), "experts_gate_up": ("experts_gate_up",),
                   "experts_down": ("experts_down",), "gate_up": ("experts_gate_up",), "experts_w1": ("experts_gate_up",),
                   "experts_w2": ("experts_down",), "mlp_experts_gate_up": ("experts_gate_up",),
                   "mlp_experts_down": ("experts_down",)}
#: ``modules_to_save`` names -> smalti's module (PEFT's names and smalti's own are both accepted).
SAVABLE = {"embed_tokens": "wte", "wte": "wte", "embed": "wte", "lm_head": "lm_head", "head": "lm_head"}
BASE_DTYPES = ("bfloat16", "float32", "nf4")


def _names(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise LoRAError(f"model.lora.{key}={value!r} must be a list of names or a comma-separated string")
    return list(value)


@dataclass(frozen=True)
class LoRAConfig:
    """The settings of ``model.lora`` (see the llm README's LoRA section).

    Args:
        r: the adapters' rank.
        alpha: the update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with ``rslora``).
        dropout: dropout on the adapters' input (training only).
        targets: ``q,k,v,o,gate,up,down`` (PEFT's ``q_proj``... also accepted) or ``all_linear`` (the linear
            layers a block has), plus on MoE models ``experts`` (every routed expert's ``gate_up`` and ``down``
            weights; ``experts_gate_up`` / ``experts_down`` for one of them, which need ``dropout=0``).
        modules_to_save: base modules trained in full and saved with the adapters: ``embed_tokens``, ``lm_head``.
        rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
        base_dtype: how the frozen base is held: ``bfloat16`` (default), ``float32`` or ``nf4`` (QLoRA: 4-bit
            NormalFloat, double-quantised block scales, through torchao's ``NF4Tensor``).
        init_from: a PEFT adapter folder to start from instead of fresh adapters.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ALL_LINEAR
    modules_to_save: tuple[str, ...] = ()
    rslora: bool = False
    base_dtype: str = "bfloat16"
    init_from: str | None = None

    @classmethod
    def from_any(cls, value: Any) -> LoRAConfig:
        """A config from ``model.lora`` (a dict or DictConfig, or a :class:`LoRAConfig`), checked."""
        if isinstance(value, LoRAConfig):
            return value
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(value, DictConfig):
                value = OmegaConf.to_container(value, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is a dependency
            pass
        if not isinstance(value, dict):
            raise LoRAError(f"model.lora={value!r} must be a mapping (r, alpha, dropout, targets, ...)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise LoRAError(f"model.lora.{unknown[0]} is not a LoRA setting; known: {', '.join(sorted(known))}")
        args = dict(value)
        args["targets"] = tuple(resolve_targets(_names(args.get("targets", list(ALL_LINEAR)), "targets")))
        args["modules_to_save"] = tuple(_savable(n) for n in _names(args.get("modules_to_save"), "modules_to_save"))
        config = cls(**args)
        config.check()
        return config

    def check(self) -> None:
        """Raise :class:`LoRAError` naming the first setting out of range."""
        if not isinstance(self.r, int) or self.r < 1:
            raise LoRAError(f"model.lora.r={self.r!r} must be a positive int")
        if not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise LoRAError(f"model.lora.alpha={self.alpha!r} must be a positive number")
        if not 0 <= self.dropout < 1:
            raise LoRAError(f"model.lora.dropout={self.dropout!r} must be in [0, 1)")
        if self.base_dtype not in BASE_DTYPES:
            raise LoRAError(f"model.lora.base_dtype={self.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if experts and self.dropout:
            raise LoRAError(f"model.lora.dropout={self.dropout} with expert targets {experts}: a per-expert weight "
                            "update takes no input dropout (nor does PEFT's target_parameters); set "
                            "model.lora.dropout=0")
        if not self.targets and not self.modules_to_save:
            raise LoRAError("model.lora.targets is empty: name the layers to adapt (e.g. all_linear or q,v)")

    @property
    def scaling(self) -> float:
        """The factor of the low-rank update ``B @ A``."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def resolve_targets(names: list[str]) -> list[str]:
    """Short target names (``q``, ``k``... in :data:`TARGETS` order) from user names, PEFT's or ``all_linear``."""
    out: set[str] = set()
    for name in names:
        key = name.lower().replace("-", "_")
        if key in ("all_linear", "all"):
            out.update(ALL_LINEAR)
            continue
        key = key.replace(".", "_").removesuffix("_proj")
        if key in _EXPERT_ALIASES:
            out.update(_EXPERT_ALIASES[key])
            continue
        if key not in TARGETS:
            raise LoRAError(f"model.lora.targets: {name!r} is not a target; use all_linear or names from "
                            f"{', '.join(TARGETS)} (PEFT's q_proj, ..., down_proj also work), or on an MoE model "
                            f"experts, {', '.join(EXPERT_TARGETS)}")
        out.add(key)
    return [t for t in (*ALL_LINEAR, *EXPERT_TARGETS) if t in out]


def _savable(name: str) -> str:
    if name not in SAVABLE:
        raise LoRAError(f"model.lora.modules_to_save: {name!r} is not a module smalti can train in full; use "
                        "embed_tokens or lm_head")
    return SAVABLE[name]
