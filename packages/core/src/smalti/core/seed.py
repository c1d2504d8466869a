"""``seed_all``: one seed for every generator a model build or a training step draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch on the CPU and every CUDA device.

    Call it before building a model in Python so its initial weights follow ``seed``; the :class:`Trainer`
    and ``smalti-train`` call it with ``trainer.seed`` before they build anything, so a model built after
    ``seed_all(s)`` has the weights of one built inside a run with ``seed=s``.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # lazily applied: does not start CUDA when it is not in use


#: Environment for bit-reproducible runs. cuBLAS needs a fixed workspace to pick deterministic GEMM kernels
#: (read when CUDA starts); oneMKL picks its GEMM code path by the operands' memory alignment and may change its
#: thread count at run time unless told not to (read at its first call).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}


def configure_determinism(num_threads: int | None = None) -> None:
    """Make this process's training bit-reproducible from run to run (``trainer.deterministic=true``).

    Deterministic algorithms only (an op without a deterministic implementation raises, naming itself),
    cuDNN without benchmarking, the variables of :data:`DETERMINISTIC_ENV` (set unless already set; they only
    act when set before CUDA and oneMKL start, which ``smalti-train`` does), and a fixed number of intra-op
    threads: ``num_threads``, else ``OMP_NUM_THREADS``, else the current count. CPU reductions split their
    work by the thread count, so two runs agree bit for bit only with the same count.
    """
    import os

    for key, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    threads = num_threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(threads)
