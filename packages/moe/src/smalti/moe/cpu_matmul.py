"""The 2-D matrix product the ``torch`` backend's expert GEMMs call on CPU, replaceable by the caller.

By default (``None``) the CPU expert products run as torch runs them: one ``torch.nn.functional.grouped_mm``
where it takes the operands, else a loop of ``torch.mm`` per expert. A caller that has a faster CPU product
(smalti-llm installs smalti-core's ``cpu_gemm.matmul_into`` when its backend is OpenBLAS) installs it with
:func:`set_cpu_matmul`; every expert product then becomes one call per expert slice:

    fn(out, a, b, *, accumulate=False) -> out      # out = a @ b (accumulate: out += a @ b)

for 2-D views, no copies: ``a``/``b`` may be transposed views (``w[e].t()`` for the input gradient,
``x[rows].t()`` for the weight gradient) and ``out`` a row slice of the result. ``fn`` decides itself which
operands it takes (dtype, strides, size) and falls back to torch for the rest, so it is called for every CPU
expert product, float64 gradient checks included. CUDA tensors never reach it.

It is process-wide state rather than a layer argument: the choice of CPU BLAS is a property of the process
(as smalti-core's ``trainer.cpu_gemm`` is), not of one layer or of its checkpoint, and the kernels are free
functions shared by the dense and the expert-parallel paths, which would otherwise all carry it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch


class CpuMatmul(Protocol):
    """``fn(out, a, b, *, accumulate=False) -> out``: ``out = a @ b`` (or ``+=``) for 2-D CPU tensors."""

    def __call__(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool = False
                 ) -> torch.Tensor: ...


_installed: CpuMatmul | None = None


def set_cpu_matmul(fn: CpuMatmul | Callable[..., torch.Tensor] | None) -> CpuMatmul | None:
    """Install ``fn`` as the CPU expert GEMMs' 2-D product (``None``: torch's own path); returns the previous one."""
    global _installed
    if fn is not None and not callable(fn):
        raise TypeError(f"set_cpu_matmul takes a callable fn(out, a, b, *, accumulate=False) or None, not {fn!r}")
    previous, _installed = _installed, fn
    return previous


def get_cpu_matmul() -> CpuMatmul | None:
    """The installed CPU product, or ``None`` when the expert GEMMs use torch's path."""
    return _installed


@contextlib.contextmanager
def cpu_matmul(fn: CpuMatmul | Callable[..., torch.Tensor] | None) -> Iterator[None]:
    """Install ``fn`` (see :func:`set_cpu_matmul`) for the duration of a ``with`` block, then restore the previous."""
    previous = set_cpu_matmul(fn)
    try:
        yield
    finally:
        set_cpu_matmul(previous)


def for_operands(*tensors: torch.Tensor) -> CpuMatmul | None:
    """The installed product when every operand is on the CPU, else ``None`` (torch's path)."""
    if _installed is None or any(t.device.type != "cpu" for t in tensors):
        return None
    return _installed


__all__ = ["CpuMatmul", "cpu_matmul", "for_operands", "get_cpu_matmul", "set_cpu_matmul"]
