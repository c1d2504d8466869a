"""Activation checkpointing and compression choices: what to recompute or compress (granularity), in which layers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from smalti.llm.errors import ModelConfigError

GRANULARITIES = ("block", "attention", "ffn")


def checkpointed_layers(layers: Any, n_layers: int) -> list[int]:
    """Layer indices to checkpoint from a ``layers`` spec.

    Accepted: ``"all"`` (or null); an int ``n`` (the first n layers); ``"first(n)"``; ``"range(m, k)"``
    (layers m..k-1, like Python's range, with an optional step); ``"every(k)"`` (0, k, 2k, ...); a list
    of indices.
    """
    if layers is None or layers == "all":
        return list(range(n_layers))
    if isinstance(layers, bool):
        raise ModelConfigError(f"activation_checkpointing.layers={layers!r}: give 'all', n, 'range(m, k)' or 'every(k)'")
    if isinstance(layers, int):
        return list(range(min(layers, n_layers)))
    if isinstance(layers, list | tuple):
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < n_layers]
        if bad:
            raise ModelConfigError(f"activation_checkpointing.layers has indices outside 0..{n_layers - 1}: {bad}")
        return sorted(set(layers))
    text = str(layers).replace(" ", "")
    match = re.fullmatch(r"(first|range|every)\((-?\d+)(?:,(-?\d+))?(?:,(-?\d+))?\)", text)
    if match:
        kind, a, b, c = match.groups()
        if kind == "first" and b is None:
            return list(range(min(int(a), n_layers)))
        if kind == "every" and b is None and int(a) > 0:
            return list(range(0, n_layers, int(a)))
        if kind == "range":
            args = [int(x) for x in (a, b, c) if x is not None]
            return [i for i in range(*args) if 0 <= i < n_layers]
    raise ModelConfigError(
        f"activation_checkpointing.layers={layers!r} is not understood; use 'all', an int n (first n layers), "
        "'range(m, k)', 'every(k)' or a list of layer indices"
    )


def parse_activation_checkpointing(spec: Any, n_layers: int) -> dict[int, str]:
    """``layer index -> granularity`` from the model's ``activation_checkpointing`` option.

    ``spec`` is null/false (off), true (every block), a granularity name, or a mapping with
    ``granularity`` (block, attention, ffn) and ``layers`` (see :func:`checkpointed_layers`).
    """
    if not spec:
        return {}
    if spec is True:
        spec = {"granularity": "block"}
    elif isinstance(spec, str):
        spec = {"granularity": spec}
    if not isinstance(spec, Mapping):
        raise ModelConfigError(f"activation_checkpointing={spec!r} must be null, true, a granularity or a mapping")
    unknown = set(spec) - {"granularity", "layers"}
    if unknown:
        raise ModelConfigError(f"activation_checkpointing has unknown keys {sorted(unknown)}; use granularity and layers")
    granularity = spec.get("granularity", "block")
    if granularity not in GRANULARITIES:
        raise ModelConfigError(
            f"activation_checkpointing.granularity={granularity!r} is not one of {', '.join(GRANULARITIES)}"
        )
    return dict.fromkeys(checkpointed_layers(spec.get("layers", "all"), n_layers), granularity)


def parse_activation_compression(spec: Any, n_layers: int) -> dict[int, tuple[str, str]]:
    """``layer index -> (format, granularity)`` from the model's ``activation_compression`` option.

    ``spec`` is null (off), a format (``bf16``, ``fp8``: every block), or a mapping with ``format``,
    ``granularity`` (block, attention, ffn: whose saved activations are compressed) and ``layers`` (see
    :func:`checkpointed_layers`). See :mod:`smalti.core.activation_compression` for the formats.
    """
    from smalti.core.activation_compression import FORMATS

    if not spec:
        return {}
    if isinstance(spec, str):
        spec = {"format": spec}
    if not isinstance(spec, Mapping):
        raise ModelConfigError(f"activation_compression={spec!r} must be null, a format or a mapping")
    unknown = set(spec) - {"format", "granularity", "layers"}
    if unknown:
        raise ModelConfigError(
            f"activation_compression has unknown keys {sorted(unknown)}; use format, granularity and layers")
    fmt, granularity = spec.get("format", "fp8"), spec.get("granularity", "block")
    if fmt not in FORMATS[1:]:
        raise ModelConfigError(f"activation_compression.format={fmt!r} is not one of {', '.join(FORMATS[1:])}")
    if granularity not in GRANULARITIES:
        raise ModelConfigError(
            f"activation_compression.granularity={granularity!r} is not one of {', '.join(GRANULARITIES)}")
    return dict.fromkeys(checkpointed_layers(spec.get("layers", "all"), n_layers), (fmt, granularity))
