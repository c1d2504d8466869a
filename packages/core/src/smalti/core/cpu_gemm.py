"""smalti's fp32 CPU matrix products through numpy's OpenBLAS where torch's MKL is slow (``trainer.cpu_gemm``).

Why: the PyTorch CPU wheel links Intel's MKL for its BLAS, and MKL takes a generic, slower code path on CPUs
that are not Intel's. On an AMD EPYC (AVX2), OpenBLAS's Haswell/Zen sgemm kernels - the OpenBLAS numpy ships
with (scipy-openblas) - run the transformer's products 20-45% faster (the core README has the figures). This
is a CPU-only kernel choice: other devices, other dtypes and everything torch does outside these products are
untouched.

- :func:`matmul_into` writes ``a @ b`` (or adds it, ``accumulate=True``) into ``out`` with OpenBLAS's
  ``cblas_sgemm`` called through :mod:`ctypes` (transposed views are passed as transpose flags, no copies), and
  with ``torch.mm``/``addmm_`` when the backend is ``torch`` or the operands are not eligible: not a plain CPU
  float32 ``torch.Tensor`` (DTensor, NF4, fake and functorch tensors are not), strides BLAS cannot take, or a
  product below :data:`MIN_FLOPS` (tiny test models keep torch's exact results).
- :func:`linear` / :class:`Linear` are ``F.linear`` / ``nn.Linear`` with forward, grad-input and grad-weight
  through :func:`matmul_into`; one ``torch.library`` custom op, so ``torch.compile`` keeps it whole.
- :func:`configure_cpu_gemm` resolves the policy (``auto|openblas|torch``); the
  :class:`~smalti.core.trainer.Trainer` calls it. :func:`backend` resolves ``auto`` lazily when nothing was
  configured, so models used outside the Trainer get the same choice.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from smalti.core._compat import is_functorch_wrapped_tensor
from smalti.core.errors import ConfigError

log = logging.getLogger(__name__)

#: The values ``trainer.cpu_gemm`` takes.
SETTINGS = ("auto", "openblas", "torch")
#: Products of fewer floating-point operations (``2*m*k*n``) stay on torch: tiny shapes gain nothing, and tests
#: of small models keep torch's exact results.
MIN_FLOPS = 1 << 26
_KEY = "trainer.cpu_gemm"
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS_ORDER / CBLAS_TRANSPOSE values
# cblas_sgemm's names in the OpenBLAS builds numpy ships (scipy-openblas, ILP64 then LP64) or a plain build.
_SYMBOLS = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
            ("scipy_cblas_sgemm", ctypes.c_int), ("cblas_sgemm", ctypes.c_int))


@dataclass(frozen=True)
class _OpenBLAS:
    """numpy's OpenBLAS as found by threadpoolctl: its file and its ``cblas_sgemm``."""

    filepath: str
    version: str
    sgemm: ctypes._CFuncPtr
    int_type: type


_backend: str | None = None  # the resolved backend, "openblas" or "torch"; None until configured or first used
_openblas: _OpenBLAS | None | bool = False  # False: not looked for yet; None: not found


def _find_openblas() -> _OpenBLAS | None:
    """numpy's BLAS when it is OpenBLAS with a ``cblas_sgemm`` we can call, else ``None`` (looked up once)."""
    global _openblas
    if _openblas is not False:
        return _openblas
    _openblas = None
    try:
        import numpy  # noqa: F401  (loads numpy's BLAS so that threadpoolctl sees it)
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    for info in threadpool_info():
        if info.get("internal_api") != "openblas" or "numpy" not in Path(info["filepath"]).parent.name:
            continue
        lib = ctypes.CDLL(info["filepath"])
        for name, int_type in _SYMBOLS:
            if hasattr(lib, name):
                sgemm = getattr(lib, name)
                sgemm.restype = None
                sgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, int_type, int_type, int_type,
                                  ctypes.c_float, ctypes.c_void_p, int_type, ctypes.c_void_p, int_type,
                                  ctypes.c_float, ctypes.c_void_p, int_type]
                _openblas = _OpenBLAS(info["filepath"], str(info.get("version")), sgemm, int_type)
                return _openblas
    return None


def _cpu_vendor() -> str:
    """The ``vendor_id`` of /proc/cpuinfo (``AuthenticAMD``, ``GenuineIntel``, ...), or ``""`` when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _torch_blas_is_mkl() -> bool:
    return torch.backends.mkl.is_available()


def _why_not_openblas(device: torch.device, cpu_vendor: str | None) -> str | None:
    """Why the OpenBLAS backend does not apply on ``device`` (``None`` when it does)."""
    if device.type != "cpu":
        return f"the device is {device.type}, not cpu"
    if _find_openblas() is None:
        return "numpy's BLAS is not an OpenBLAS with a callable cblas_sgemm (threadpoolctl found none)"
    vendor = _cpu_vendor() if cpu_vendor is None else cpu_vendor
    if vendor == "GenuineIntel":
        return "the CPU is Intel's, where torch's MKL is fast"
    if not _torch_blas_is_mkl():
        return "torch's BLAS is not MKL"
    return None


def _use_openblas_threads() -> None:
    """One OpenBLAS thread, whatever torch's count: OpenBLAS's threaded sgemm splits some products differently by
    thread count, and smalti's default mode promises the same losses bit for bit with 1 or 2 intra-op threads
    (tests/test_llm_e2e.py). Products then run on one core; on many-core CPUs ``trainer.cpu_gemm=torch`` keeps
    MKL's threads."""
    from threadpoolctl import ThreadpoolController

    assert isinstance(_openblas, _OpenBLAS)
    ThreadpoolController().select(filepath=_openblas.filepath).limit(limits=1)


def configure_cpu_gemm(setting: str, device: torch.device | str = "cpu", *, cpu_vendor: str | None = None) -> str:
    """Choose the backend of smalti's fp32 CPU products for a run on ``device``; return what was chosen and why.

    ``auto`` picks ``openblas`` when the device is the CPU, torch's BLAS is MKL, the CPU is not Intel's
    (``cpu_vendor``, default /proc/cpuinfo's ``vendor_id``) and numpy's BLAS is OpenBLAS; else ``torch``.
    ``openblas`` insists (a :class:`ConfigError` saying why when it cannot apply); ``torch`` switches it off.
    With ``openblas`` chosen, OpenBLAS runs on one thread (results independent of torch's thread count). The choice is logged
    at INFO when it changes. Raises :class:`ConfigError` naming ``trainer.cpu_gemm`` for an unknown setting.
    """
    global _backend
    if setting not in SETTINGS:
        raise ConfigError(f"{_KEY}={setting!r}: give one of {', '.join(SETTINGS)} (auto: OpenBLAS on non-Intel "
                          f"CPUs where torch uses MKL; torch: always torch's own BLAS)")
    device = torch.device(device)
    why_not = None if setting == "torch" else _why_not_openblas(device, cpu_vendor)
    if setting == "openblas" and why_not is not None:
        raise ConfigError(f"{_KEY}=openblas cannot apply: {why_not}; use auto or torch")
    chosen = "openblas" if setting != "torch" and why_not is None else "torch"
    if chosen == "openblas":
        _use_openblas_threads()
        message = (f"{_KEY}={setting}: fp32 CPU matrix products through numpy's OpenBLAS "
                   f"{_openblas.version} on one thread (torch: torch's own BLAS)")
    elif setting == "torch":
        message = f"{_KEY}=torch: fp32 CPU matrix products through torch's own BLAS"
    else:
        message = f"{_KEY}=auto: torch's own BLAS, as {why_not}"
    if chosen != _backend:
        log.info(message)
    _backend = chosen
    return message


def backend() -> str:
    """The backend of smalti's fp32 CPU products, ``openblas`` or ``torch`` (``auto`` for CPU when not configured)."""
    if _backend is None:
        configure_cpu_gemm("auto", "cpu")
    return _backend


def _blas_layout(t: Tensor) -> tuple[bool, int] | None:
    """``(transposed, leading dimension)`` to pass 2-D ``t`` to row-major BLAS, or ``None`` if its strides do not fit."""
    rows, cols = t.shape
    s0, s1 = t.stride()
    if (s1 == 1 or cols == 1) and (rows == 1 or s0 >= cols):
        return False, max(s0 if rows > 1 else cols, cols, 1)
    if (s0 == 1 or rows == 1) and (cols == 1 or s1 >= rows):
        return True, max(s1 if cols > 1 else rows, rows, 1)
    return None


_PLAIN = (torch.Tensor, nn.Parameter)  # exactly these: subclasses (DTensor, NF4Tensor, FakeTensor) go to torch


def _plain_fp32_cpu(t: Tensor) -> bool:
    return (type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.layout == torch.strided and t.dim() == 2 and not t.is_neg()
            and not is_functorch_wrapped_tensor(t))


def _span(t: Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + 4 * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))


def _eligible(out: Tensor, a: Tensor, b: Tensor) -> bool:
    if not (_plain_fp32_cpu(out) and _plain_fp32_cpu(a) and _plain_fp32_cpu(b)):
        return False
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0 or 2 * m * k * n < MIN_FLOPS or out.shape != (m, n) or b.shape[0] != k:
        return False
    if torch.is_grad_enabled() and (out.requires_grad or a.requires_grad or b.requires_grad):
        return False  # torch.mm(out=) says why autograd cannot go through it
    out_start, out_end = _span(out)
    if any(start < out_end and out_start < end for start, end in (_span(a), _span(b))):
        return False  # BLAS would read what it already wrote
    layout = _blas_layout(out)
    return layout is not None and not layout[0] and _blas_layout(a) is not None and _blas_layout(b) is not None


def _openblas_sgemm(out: Tensor, a: Tensor, b: Tensor, beta: float) -> None:
    """``out = a @ b + beta * out`` with OpenBLAS's cblas_sgemm (operands already checked by :func:`_eligible`)."""
    (m, k), n = a.shape, b.shape[1]
    trans_a, lda = _blas_layout(a)
    trans_b, ldb = _blas_layout(b)
    ldc = _blas_layout(out)[1]
    _openblas.sgemm(_ROW_MAJOR, _TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS,
                    m, n, k, 1.0, a.data_ptr(), lda, b.data_ptr(), ldb, beta, out.data_ptr(), ldc)


def matmul_into(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool = False) -> Tensor:
    """``out = a @ b`` (``out += a @ b`` with ``accumulate``) for 2-D CPU float32 tensors; returns ``out``.

    No autograd: callers are inside autograd Functions or ``no_grad``. With the ``openblas`` backend and
    eligible operands (plain CPU float32 tensors, each row-major or a transposed view of one, ``out`` row-major
    and apart from ``a`` and ``b``, ``2*m*k*n >= MIN_FLOPS``) one OpenBLAS sgemm does it, with ``beta=1`` when
    accumulating; otherwise ``torch.mm(a, b, out=out)`` / ``out.addmm_(a, b)``.
    """
    if backend() == "openblas" and _eligible(out, a, b):
        _openblas_sgemm(out, a, b, 1.0 if accumulate else 0.0)
        return out
    if accumulate:
        return out.addmm_(a, b)
    return torch.mm(a, b, out=out)


# --- linear: F.linear with its three products through matmul_into -----------------------------------------------


@torch.library.custom_op("smalti_core::cpu_linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if bias is not None:
        out.copy_(bias.expand_as(out))
    matmul_into(out, x2, weight.t(), accumulate=bias is not None)
    return out.view(*x.shape[:-1], weight.shape[0])


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("smalti_core::cpu_linear_grad_input", mutates_args=())
def _grad_input_op(grad: Tensor, weight: Tensor) -> Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    out = torch.empty(g2.shape[0], weight.shape[1], dtype=grad.dtype, device=grad.device)
    matmul_into(out, g2, weight)
    return out.view(*grad.shape[:-1], weight.shape[1])


@_grad_input_op.register_fake
def _(grad: Tensor, weight: Tensor) -> Tensor:
    return grad.new_empty(*grad.shape[:-1], weight.shape[1])


@torch.library.custom_op("smalti_core::cpu_linear_grad_weight", mutates_args=())
def _grad_weight_op(grad: Tensor, x: Tensor) -> Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(g2.shape[1], x2.shape[1], dtype=x.dtype, device=x.device)
    return matmul_into(out, g2.t(), x2)


@_grad_weight_op.register_fake
def _(grad: Tensor, x: Tensor) -> Tensor:
    return x.new_empty(grad.shape[-1], x.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    ctx.need_x, ctx.need_w, ctx.need_b = need_x, need_w, need_b and bias is not None
    ctx.save_for_backward(x if need_w else None, weight if need_x else None)


def _backward(ctx, grad: Tensor):
    x, weight = ctx.saved_tensors
    grad_x = _grad_input_op(grad, weight) if ctx.need_x else None
    grad_w = _grad_weight_op(grad, x) if ctx.need_w else None
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.need_b else None
    return grad_x, grad_w, grad_b


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _linear_eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if torch.is_autocast_enabled("cpu") or backend() != "openblas":
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(type(t) not in _PLAIN or t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False  # F.linear gives the error
    tokens = math.prod(x.shape[:-1])
    return 2 * tokens * weight.shape[0] * weight.shape[1] >= MIN_FLOPS


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with its forward and gradient products through :func:`matmul_into`.

    Falls back to ``F.linear`` when the backend is ``torch``, under CPU autocast, for tensors other than plain
    CPU float32 ones (DTensor, NF4, ...) and for products below :data:`MIN_FLOPS`. Gradients that are not needed
    (frozen weight, input without grad) are not computed. Works under activation checkpointing and
    ``torch.compile`` (a ``torch.library`` custom op with its autograd and fake registered).
    """
    if not _linear_eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    return _linear_op(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict names and initialisation) whose forward is :func:`linear`."""

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)
