"""What the mixture-of-experts families share: their router and auxiliary-loss fields read into smalti-moe's
options (and written back), checks that a smalti model's MoE is theirs, and their expert weights mapped onto
smalti-moe's stacked ``w1 [E, d, 2 ffn]`` (gate columns, then up) and ``w2 [E, ffn, d]``.

Hugging Face stores an expert's linear weights ``[out, in]`` and smalti-moe ``[in, out]``, so every expert part
is ``transposed``. Folders come either with one tensor per expert (what ``transformers`` 5 writes for Mixtral,
Qwen-MoE and OLMoE) or with the experts fused (``experts.gate_up_proj [E, 2 ffn, d]`` and ``experts.down_proj
[E, d, ffn]``, the layout ``transformers`` holds in memory); both are read, and the per-expert one is written.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.family import Part, WeightParts


def moe_options(cfg: dict[str, Any], path: Path, num_experts: int, top_k: int, norm_topk_prob: bool,
                jitter: float = 0.0) -> dict[str, Any]:
    """smalti-moe's options for a softmax top-k router (softmax over every expert, then top-k, renormalised when
    ``norm_topk_prob``) with Hugging Face's pooled load-balancing loss (``router_aux_loss_coef``, added to the
    loss when ``output_router_logits``)."""
    if not 1 <= top_k <= num_experts:
        raise ConversionError(f"{path}: num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    if not 0 <= jitter < 1:
        raise ConversionError(f"{path}: router_jitter_noise={jitter} is not supported (smalti-moe takes 0 <= "
                              "jitter < 1)")
    coef = cfg.get("router_aux_loss_coef", 0.001)
    return {
        "num_experts": num_experts, "top_k": top_k, "mlp_type": "glu", "activation": "silu", "score_func": "softmax",
        "normalize_expert_weights": 1.0 if norm_topk_prob else None, "router_jitter": float(jitter),
        "jitter_experts": True, "lbl_weight": float(coef), "lbl_scope": "model",
        "load_balancing": "aux_loss" if cfg.get("output_router_logits") else "none",
    }


def moe_problems(c: dict[str, Any], norm_topk_prob: bool | None = None) -> list[str]:
    """Why a smalti model ``c``'s MoE is not such a router (``norm_topk_prob`` None: either renormalisation)."""
    moe = c.get("moe") or {}
    expected = {"mlp_type": "glu", "score_func": "softmax", "lbl_scope": "model", "num_shared_experts": 0,
                "shared_expert_size": 0, "capacity_factor": None, "zloss_weight": 0.0}
    out = [f"moe.{key}={moe.get(key)!r} (it has {value!r})" for key, value in expected.items()
           if (moe.get(key) or None) != (value or None)]
    if moe.get("load_balancing", "aux_loss") not in ("aux_loss", "none"):
        out.append(f"moe.load_balancing={moe['load_balancing']!r} (it has a loss or none)")
    renorm = moe.get("normalize_expert_weights")
    if renorm not in (None, 1, 1.0):
        out.append(f"moe.normalize_expert_weights={renorm!r} (it renormalises to sum one or not at all)")
    if norm_topk_prob is not None and (renorm is not None) != norm_topk_prob:
        out.append(f"moe.normalize_expert_weights={renorm!r} (it {'' if norm_topk_prob else 'never '}renormalises)")
    return out


def moe_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The router and aux-loss ``config.json`` fields every MoE family shares, from a smalti model ``c``."""
    moe = c["moe"]
    return {"num_experts_per_tok": moe["top_k"], "router_aux_loss_coef": moe.get("lbl_weight", 0.001),
            "output_router_logits": moe.get("load_balancing", "aux_loss") == "aux_loss"}


def expert_parts(layer: str, num_experts: int, hidden: int, names: Collection[str] | None, router: str,
                 per_expert: tuple[str, str, str], fused: str, fused_router: str | None = None) -> WeightParts:
    """Layer ``layer``'s router and experts (smalti prefix ``blocks.{layer}.ffn.moe.``).

    ``router``: the Hugging Face router weight; ``per_expert``: the gate, up and down names of expert ``{e}``
    (``model.layers.0.mlp.experts.{e}.gate_proj.weight``); ``fused``: the prefix of the fused tensors
    (``model.layers.0.mlp.experts.``), read when the folder has ``<fused>gate_up_proj``, with the router then
    named ``fused_router`` (default ``router``).
    """
    src = f"blocks.{layer}.ffn.moe."
    out: WeightParts = {src + "router.gate.weight": [Part(router, 0, num_experts)]}
    if names is not None and fused + "gate_up_proj" in names:
        out[src + "router.gate.weight"] = [Part(fused_router or router, 0, num_experts)]
        out[src + "w1"] = [Part(fused + "gate_up_proj", 0, num_experts, transposed=True)]
        out[src + "w2"] = [Part(fused + "down_proj", 0, num_experts, transposed=True)]
        return out
    gate, up, down = per_expert
    out[src + "w1"] = [
        Part(name.format(e=e), e, e + 1, transposed=True, stacked=True, cols=cols)
        for e in range(num_experts) for name, cols in ((gate, (0, hidden)), (up, (hidden, 2 * hidden)))
    ]
    out[src + "w2"] = [Part(down.format(e=e), e, e + 1, transposed=True, stacked=True) for e in range(num_experts)]
    return out
