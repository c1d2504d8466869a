"""Compressed activations: the tensors autograd keeps for backward stored in a smaller format, restored there.

DBRX's training combined selective activation checkpointing with compression of what is kept. Here a
:class:`ActivationCompression` is a context in which every activation saved for backward is packed by
``torch.autograd.graph.saved_tensors_hooks``:

* ``bf16``: float32 activations stored as bfloat16 (half the bytes; what bf16 autocast computes in anyway);
* ``fp8``: float32/bfloat16/float16 activations stored as float8 e4m3 with one float32 scale per block of 128
  values (about a quarter of fp32's bytes, half of bf16's), each block scaled so its largest value is e4m3's
  largest (448);
* ``none``: stored as they are; only counted (the baseline of a measurement).

Only activations are packed: tensors produced by the forward (not parameters, buffers or inputs, and not the
bf16 copies autocast makes of parameters, which live anyway and would only be duplicated) of at least
``min_numel`` values. A tensor saved by several operations (a norm's output read by two projections) is packed
once. ``stats`` counts what was saved and what is stored.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FORMATS = ("none", "bf16", "fp8")
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class CompressionStats:
    """Bytes of the activations saved in a context: as produced, and as stored."""

    saved_bytes: int = 0
    stored_bytes: int = 0
    tensors: int = 0

    @property
    def ratio(self) -> float:
        """Stored over saved bytes (1.0 when nothing was saved)."""
        return self.stored_bytes / self.saved_bytes if self.saved_bytes else 1.0


def _is_activation(t: torch.Tensor) -> bool:
    fn = t.grad_fn
    if fn is None:
        return False  # a parameter, buffer or input: it lives anyway
    # not autocast's low-precision copy of a parameter, which is cached for the whole forward
    return not (type(fn).__name__ == "ToCopyBackward0" and any(
        type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None))


#: Values converted at a time: bounds the float32 temporaries of packing and unpacking to a few MiB, so that
#: compressing a large activation does not first need several times its size.
_CHUNK = 1 << 20


def pack_fp8(t: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as float8 e4m3 values in blocks of ``block`` (the last one zero-padded) and each block's float32 amax."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    blocks = -(-n // block)
    values = torch.empty(blocks, block, dtype=_FP8, device=t.device)
    amax = torch.empty(blocks, 1, dtype=torch.float32, device=t.device)
    step = max(1, _CHUNK // block)
    for first in range(0, blocks, step):
        last = min(blocks, first + step)
        part = flat[first * block: last * block].float()
        if part.numel() < (last - first) * block:
            part = F.pad(part, (0, (last - first) * block - part.numel()))
        part = part.view(-1, block)
        peak = part.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        amax[first:last] = peak
        values[first:last] = (part * (_FP8_MAX / peak)).to(_FP8)
    return values, amax


def unpack_fp8(values: torch.Tensor, amax: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack_fp8` (to within e4m3's rounding)."""
    n = shape.numel()
    out = torch.empty(n, dtype=dtype, device=values.device)
    block = values.shape[1]
    step = max(1, _CHUNK // block)
    for first in range(0, values.shape[0], step):
        last = min(values.shape[0], first + step)
        part = (values[first:last].float() * (amax[first:last] / _FP8_MAX)).view(-1)
        end = min(n, last * block)
        out[first * block: end] = part[: end - first * block]
    return out.view(shape)


class ActivationCompression:
    """A context (``with compression:``) that stores the activations saved in it in ``fmt`` (see the module)."""

    def __init__(self, fmt: str = "fp8", min_numel: int = 4096, block: int = 128) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"activation compression format {fmt!r} must be one of {', '.join(FORMATS)}")
        self.fmt, self.min_numel, self.block = fmt, int(min_numel), int(block)
        self.stats = CompressionStats()
        self._seen: dict[tuple[Any, ...], Any] = {}
        self._hooks: Any = None

    def __enter__(self) -> ActivationCompression:
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks, self._seen = None, {}

    def _pack(self, t: torch.Tensor) -> Any:
        if t.dtype not in _FLOATS or t.numel() < self.min_numel or not _is_activation(t):
            return t
        # The same tensor object saved again (a norm's output read by two projections) is packed once. Keyed by
        # identity and checked through a weak reference: an address or id may be reused by a later tensor once
        # an earlier one is freed.
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        nbytes = t.numel() * t.element_size()
        if self.fmt == "fp8":
            values, amax = pack_fp8(t, self.block)
            packed = ("fp8", values, amax, t.shape, t.dtype)
            stored = values.numel() + amax.numel() * 4
        elif self.fmt == "bf16" and t.dtype == torch.float32:
            packed = ("bf16", t.detach().to(torch.bfloat16), t.dtype)
            stored = nbytes // 2
        else:
            packed = ("as_is", t)
            stored = nbytes
        self.stats.saved_bytes += nbytes
        self.stats.stored_bytes += stored
        self.stats.tensors += 1
        self._seen[id(t)] = (weakref.ref(t), t._version, packed)
        return packed

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        kind = packed[0]
        if kind == "fp8":
            return unpack_fp8(packed[1], packed[2], packed[3], packed[4])
        if kind == "bf16":
            return packed[1].to(packed[2])
        return packed[1]
