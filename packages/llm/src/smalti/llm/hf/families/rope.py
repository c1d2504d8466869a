"""Rotary-embedding fields of a ``config.json``, shared by the RoPE families (both transformers 4's
``rope_theta`` + ``rope_scaling`` layout and transformers 5's ``rope_parameters``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError

ROPE_TYPES = ("default", "linear", "llama3")


def read_rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` for :class:`~smalti.llm.LLM`, refusing a kind smalti does not reproduce."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(cfg.get("rope_scaling") or params)
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise ConversionError(
            f"{path}: {field}.rope_type={kind!r} is not supported (smalti reproduces {', '.join(ROPE_TYPES)} "
            "rotary embeddings exactly); use a model with one of those"
        )
    for extra in ("partial_rotary_factor", "mrope_section"):
        if scaling.get(extra) not in (None, 1.0):
            raise ConversionError(f"{path}: {field}.{extra}={scaling[extra]!r} is not supported by smalti's RoPE")
    if kind == "default":
        return theta, None
    scaling.pop("attention_factor", None)  # unused by linear and llama3 rotary embeddings
    return theta, {"type": kind, **scaling}


def hf_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """smalti's ``rope_scaling`` as ``config.json``'s."""
    if not scaling:
        return None
    out = dict(scaling)
    out["rope_type"] = out.pop("type", out.get("rope_type"))
    return out
