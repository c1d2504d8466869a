"""Maps smalti-llm's ``model.moe`` options onto the keyword arguments of :class:`smalti.moe.MoE`."""

from __future__ import annotations

import inspect
from typing import Any

from smalti.llm.errors import ModelConfigError


def moe_kwargs(d_model: int, hidden: int, activation: str, bias: bool, moe: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``smalti.moe.MoE``: MegaBlocks-style names, filled from the model's sizes.

    ``moe`` may use the short names ``num_experts``, ``top_k``, ``loss_weight``, ``mlp_type`` or the
    MegaBlocks ones (``moe_num_experts``, ...); unknown keys are an error naming the accepted ones.
    """
    from smalti.moe import MoE

    aliases = {"num_experts": "moe_num_experts", "top_k": "moe_top_k", "loss_weight": "moe_loss_weight"}
    args: dict[str, Any] = {"hidden_size": d_model, "ffn_hidden_size": hidden}
    for key, value in moe.items():
        args[aliases.get(key, key)] = value
    args.setdefault("mlp_type", "glu" if activation == "silu" else "mlp")
    args.setdefault("activation_fn", activation)
    accepted = set(inspect.signature(MoE).parameters)
    if "kwargs" in accepted or "args" in accepted:
        return args
    unknown = sorted(k for k in args if k not in accepted)
    if unknown:
        # The defaults we set are only hints; drop those the layer does not take, and fail on the user's keys.
        for key in ("mlp_type", "activation_fn"):
            if key in unknown and key not in moe:
                args.pop(key)
                unknown.remove(key)
    if unknown:
        raise ModelConfigError(
            f"model.moe has keys smalti.moe.MoE does not accept: {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    return args
