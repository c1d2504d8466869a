"""Maps smalti-llm's ``model.moe`` options onto the keyword arguments of :class:`smalti.moe.MoE`."""

from __future__ import annotations

import inspect
from typing import Any

from smalti.llm.errors import ModelConfigError


def moe_kwargs(d_model: int, hidden: int, activation: str, bias: bool, moe: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``smalti.moe.MoE``: MegaBlocks-style names, filled from the model's sizes.

    ``moe`` uses smalti-moe's names (``num_experts``, ``top_k``, ``lbl_weight``, ...); ``loss_weight`` and
    MegaBlocks' ``moe_``-prefixed names are accepted too. Unknown keys are an error naming the accepted ones.
    """
    from smalti.moe import MoE

    aliases = {
        "loss_weight": "lbl_weight",
        "moe_num_experts": "num_experts",
        "moe_top_k": "top_k",
        "moe_loss_weight": "lbl_weight",
        "moe_zloss_weight": "zloss_weight",
        "moe_capacity_factor": "capacity_factor",
        "moe_jitter_eps": "router_jitter",
        "moe_normalize_expert_weights": "normalize_expert_weights",
        "activation_fn": "activation",
    }
    args: dict[str, Any] = {"hidden_size": d_model, "ffn_hidden_size": hidden}
    for key, value in moe.items():
        args[aliases.get(key, key)] = value
    args.setdefault("mlp_type", "glu" if activation == "silu" else "mlp")
    args.setdefault("activation", activation)
    accepted = set(inspect.signature(MoE).parameters)
    if "kwargs" in accepted or "args" in accepted:
        return args
    unknown = sorted(k for k in args if k not in accepted)
    if unknown:
        # The defaults we set are only hints; drop those the layer does not take, and fail on the user's keys.
        for key in ("mlp_type", "activation"):
            if key in unknown and key not in moe:
                args.pop(key)
                unknown.remove(key)
    if unknown:
        raise ModelConfigError(
            f"model.moe has keys smalti.moe.MoE does not accept: {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    return args
