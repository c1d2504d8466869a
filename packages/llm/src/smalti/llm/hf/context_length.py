"""How long a sequence ``model=hf`` trains on: never past the model's positions without saying so.

A Hugging Face folder's ``config.json`` says how many positions the model was trained on
(``max_position_embeddings``). ``model=hf`` defaults ``max_seq_len`` to the smaller of that and
:data:`DEFAULT_MAX_SEQ_LEN` (the ``${smalti_hf_max_seq_len:...}`` resolver in ``conf/model/hf.yaml``, so the chat
data's rows get the same length); a longer ``model.max_seq_len`` is allowed but warned about, naming the RoPE
scaling the config applies, if any.

Import-light: the resolver runs while Hydra composes a run, before torch is imported.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: ``model=hf``'s sequence length when the folder's model has at least this many positions.
DEFAULT_MAX_SEQ_LEN = 2048
RESOLVER = "smalti_hf_max_seq_len"


def trained_positions(config: dict[str, Any]) -> int | None:
    """``max_position_embeddings`` of a Hugging Face ``config.json`` (``None`` when it does not say)."""
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int | float) and value > 0 else None


def default_max_seq_len(pretrained: Any) -> int:
    """The ``${smalti_hf_max_seq_len:<folder>}`` resolver: ``min(2048, max_position_embeddings)`` of the folder.

    A folder that cannot be read gives :data:`DEFAULT_MAX_SEQ_LEN`; building the model then names what is wrong.
    """
    path = Path(os.path.expanduser(str(pretrained))) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_MAX_SEQ_LEN
    positions = trained_positions(config) if isinstance(config, dict) else None
    return min(DEFAULT_MAX_SEQ_LEN, positions) if positions else DEFAULT_MAX_SEQ_LEN


def rope_scaling_phrase(config: dict[str, Any]) -> str:
    """What RoPE scaling ``config`` applies, in words (``"rope_scaling llama3 (factor=8.0, ...)"`` or none)."""
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if kind == "default":
        return "the config applies no RoPE scaling, so positions past them are extrapolated"
    detail = ", ".join(f"{k}={v}" for k, v in sorted(scaling.items()))
    return f"the config applies RoPE scaling {kind!r} ({detail})"


def warn_if_past_positions(max_seq_len: int, config: dict[str, Any], config_path: str | os.PathLike) -> bool:
    """Log a warning when ``max_seq_len`` is longer than the positions the model was trained on; True if so."""
    positions = trained_positions(config)
    if positions is None or max_seq_len <= positions:
        return False
    log.warning(
        "model.max_seq_len=%d is longer than max_position_embeddings=%d in %s: the model was not trained on "
        "positions past %d and %s. Lower model.max_seq_len to %d or less, or train on long data first.",
        max_seq_len, positions, config_path, positions, rope_scaling_phrase(config), positions,
    )
    return True


def register_resolver() -> None:
    """Make ``${smalti_hf_max_seq_len:<folder>}`` available to OmegaConf (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, default_max_seq_len, use_cache=False)
