"""Make glibc return freed training tensors to the OS on CPU (``trainer.cpu_malloc_mmap_threshold``).

Why: glibc's ``malloc`` serves a block smaller than its *mmap threshold* from the heap, and a freed heap
block stays in the process (only the heap's top can shrink). The threshold starts at 128 KiB but is
*dynamic*: each time a block that came from ``mmap`` is freed, glibc raises the threshold to that block's
size (up to 32 MiB on 64-bit). A training step frees many activation and gradient tensors of a few MB, so after
the first step every tensor below ~32 MB comes from the heap, and what the step frees is kept, pinned by the
small long-lived allocations between those blocks. PyTorch's own CPU allocator has no cache (every tensor is a
``malloc``/``free``), so this retained memory adds to the process's peak; the core README has the figures.

:func:`configure_cpu_malloc` sets the threshold with ``mallopt(M_MMAP_THRESHOLD, n)``, which also fixes it
(glibc stops raising it dynamically): every block of ``n`` bytes or more is its own mapping, returned to the OS
when the tensor is freed. The :class:`~smalti.core.trainer.Trainer` calls it when its device is the CPU. It
leaves libc alone when the setting is ``None``, when the C library is not glibc (musl, macOS), and when the
user set glibc's own ``MALLOC_MMAP_THRESHOLD_`` environment variable (glibc read that at start; it wins).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

from smalti.core.errors import ConfigError

log = logging.getLogger(__name__)

#: ``trainer.cpu_malloc_mmap_threshold``'s default: blocks of 1 MiB or more are mapped on their own.
DEFAULT_MMAP_THRESHOLD = 1 << 20
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``: 4 MiB * sizeof(long)).
MAX_MMAP_THRESHOLD = 32 << 20
#: The environment variable glibc reads at process start; when set, smalti does not override it.
ENV_VAR = "MALLOC_MMAP_THRESHOLD_"
_KEY = "trainer.cpu_malloc_mmap_threshold"
_M_MMAP_THRESHOLD = -3  # from glibc's <malloc.h>

_applied: int | None = None  # the threshold this process set, so the log line is written once


def _check(threshold: object) -> int:
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 < threshold <= MAX_MMAP_THRESHOLD:
        raise ConfigError(
            f"{_KEY}={threshold!r}: give a whole number of bytes between 1 and {MAX_MMAP_THRESHOLD} (glibc's "
            f"largest mmap threshold), e.g. {DEFAULT_MMAP_THRESHOLD} (1 MiB), or null to leave the C library alone"
        )
    return threshold


def configure_cpu_malloc(threshold: int | None, device: torch.device | str = "cpu") -> str:
    """Fix glibc's mmap threshold at ``threshold`` bytes for a run on ``device``; return what was done.

    ``threshold=None`` leaves the C library as it is. Nothing is changed either when ``device`` is not the
    CPU, the C library is not glibc, or ``MALLOC_MMAP_THRESHOLD_`` is set in the environment. The outcome
    is logged at INFO the first time the threshold is set in a process; the returned sentence says why when
    nothing was set. Raises :class:`ConfigError` for a threshold that is not 1..32 MiB.
    """
    global _applied
    if threshold is None:
        return f"{_KEY}=null: the C library's allocator is left as it is"
    threshold = _check(threshold)
    if torch.device(device).type != "cpu":
        return f"{_KEY}: not applied, the device is {torch.device(device).type}, not cpu"
    if os.environ.get(ENV_VAR):
        return f"{_KEY}: not applied, {ENV_VAR}={os.environ[ENV_VAR]} is set in the environment and wins"
    if platform.libc_ver()[0] != "glibc":
        return f"{_KEY}: not applied, the C library is not glibc"
    if _applied == threshold:
        return f"{_KEY}: glibc's mmap threshold already fixed at {threshold} bytes"
    if not ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold):
        raise ConfigError(f"{_KEY}={threshold}: glibc's mallopt refused it; give a smaller value or null")
    _applied = threshold
    message = (f"{_KEY}: glibc's mmap threshold fixed at {threshold} bytes (freed blocks of that size or more "
               f"go back to the OS; null leaves libc alone)")
    log.info(message)
    return message
