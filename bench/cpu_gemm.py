"""torch.mm against smalti.core.cpu_gemm.matmul_into on the products of a training step, in the same run.

For each linear layer shape ``(tokens m, in k, out n)`` of the 1B-like model and the LM head's chunk, the three
products of ``y = x @ W.T``: forward (``x @ W.T``), grad input (``dy @ W``) and grad weight (``dy.T @ x``), each
timed as GFLOP/s in process CPU time (best of ``--repeats`` rounds of about ``--round-gflop`` GFLOP each, so
another process's burst does not count), torch first, then ``matmul_into`` with the backend ``trainer.cpu_gemm=auto`` resolves to
(or ``--backend``). Threads: ``torch.get_num_threads()`` (set ``OMP_NUM_THREADS``); OpenBLAS gets the same.

    OMP_NUM_THREADS=1 python bench/cpu_gemm.py [--backend auto|openblas|torch] [--round-gflop 20] [--repeats 2]

Last line: ``cpu_gemm: worst X.XX median X.XX (matmul_into / torch.mm, <backend>)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from smalti.core import cpu_gemm

#: (tokens, in features, out features): the 1B-like model's projections, a square one, the head's chunk and a
#: smaller model's MLP.
SHAPES = [(1024, 1024, 4096), (1024, 4096, 1024), (1024, 1024, 1024), (523, 1024, 128256), (2048, 512, 1536)]


def _gflops(flops: int, run: Callable[[], object], iters: int, repeats: int) -> float:
    run()  # warm-up: first-touch of the output, BLAS buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(iters):
            run()
        best = min(best, (time.process_time() - start) / iters)
    return flops / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=cpu_gemm.SETTINGS, default="auto")
    parser.add_argument("--round-gflop", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(cpu_gemm.configure_cpu_gemm(args.backend, "cpu"))
    backend = cpu_gemm.backend()
    torch.manual_seed(0)
    ratios = []
    print(f"{'m,k,n':>20} {'product':>8} {'torch GF/s':>11} {'ours GF/s':>10} {'ratio':>6}")
    for m, k, n in SHAPES:
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        y, dx, dw = torch.empty(m, n), torch.empty(m, k), torch.empty(n, k)
        products = {"fwd": (y, x, w.t()), "dx": (dx, dy, w), "dW": (dw, dy.t(), x)}
        for name, (out, a, b) in products.items():
            flops = 2 * m * k * n
            iters = max(1, round(args.round_gflop * 1e9 / flops))
            ref = _gflops(flops, partial(torch.mm, a, b, out=out), iters, args.repeats)
            ours = _gflops(flops, partial(cpu_gemm.matmul_into, out, a, b), iters, args.repeats)
            ratios.append(ours / ref)
            print(f"{f'{m},{k},{n}':>20} {name:>8} {ref:11.1f} {ours:10.1f} {ours / ref:6.2f}", flush=True)
    print(f"cpu_gemm: worst {min(ratios):.2f} median {statistics.median(ratios):.2f} "
          f"(matmul_into / torch.mm, {backend})")


if __name__ == "__main__":
    main()
