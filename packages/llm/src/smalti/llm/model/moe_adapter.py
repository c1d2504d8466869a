"""Maps smalti-llm's ``model.moe`` options onto the keyword arguments of :class:`smalti.moe.MoE`, and gives
smalti-moe's CPU expert GEMMs smalti-core's CPU product (:func:`install_cpu_matmul`)."""

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


def install_cpu_matmul() -> str:
    """Route smalti-moe's CPU expert GEMMs through ``smalti.core.cpu_gemm.matmul_into`` when smalti-core's CPU GEMM
    backend is ``openblas`` (``trainer.cpu_gemm``; ``auto`` on non-Intel CPUs where torch uses MKL), and back to
    torch's own path when it is ``torch``; returns the backend. A product some other code installed is left alone.

    smalti-moe depends on no sibling package, so it takes the product as a plug
    (:func:`smalti.moe.ops.set_cpu_matmul`); this package depends on both and connects them when it builds an MoE
    layer. ``matmul_into`` checks the backend on every call too, so a later ``trainer.cpu_gemm=torch`` is honoured.
    """
    from smalti.core import cpu_gemm
    from smalti.moe import ops

    backend = cpu_gemm.backend()
    current = ops.get_cpu_matmul()
    if backend == "openblas" and current is None:
        ops.set_cpu_matmul(cpu_gemm.matmul_into)
    elif backend != "openblas" and current is cpu_gemm.matmul_into:
        ops.set_cpu_matmul(None)
    return backend
