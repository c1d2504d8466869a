"""Forward+backward time of the dropless MoE layer against a dense FFN with the same active parameters per token.

The dense FFN has hidden size ``F``; the MoE has ``E`` experts of hidden size ``F / k`` and routes each
token to ``k`` of them, so both spend the same FLOPs per token on the FFN. Both run in the same process,
alternating, and the script prints the median times, tokens/s and the ratio ``moe / dense``.
Goals: <= 1.5 on CPU (torch backend) at 8 experts top-2; <= 1.1 on an H100 (triton backend) at
DBRX-like shapes (16 experts, top-4).

    python bench/moe_layer.py                      # CPU, torch backend
    python bench/moe_layer.py --preset dbrx        # GPU, triton backend, bf16: 16 experts top-4, hidden 6144,
                                                   # expert ffn 10752 (dense ffn 43008), 8192 tokens

``--gemm`` times the grouped GEMM alone instead, at the layer's shapes (``tokens * top_k`` rows routed at
random, the GLU experts' two projections), for the forward product, the input gradient (``w`` transposed, a
strided view) and the weight gradient, by each way of computing it: smalti-moe's torch backend
(``reference.grouped_mm`` / ``grouped_mm_wgrad``, what the layer runs), a Python loop of ``torch.mm`` per
expert, ``torch.nn.functional.grouped_mm``, ``torch._grouped_mm``, a ``bmm`` over the experts' rows padded
to the largest expert (the padded rows are computed and thrown away), and, where smalti-core's ``cpu_gemm`` can use
numpy's OpenBLAS, smalti-moe's torch backend with that product installed (``smalti (openblas)``). Process CPU ms per call (best of
``--repeats``) and GFLOP/s of the useful work; a dense ``mm`` of the same rows is the yardstick:

    python bench/moe_layer.py --gemm --tokens 2048 --ffn 3584      # bench/moe_vs_hf.py's Mixtral-like shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from smalti.moe import MoE


class DenseFFN(nn.Module):
    def __init__(self, hidden: int, ffn: int, glu: bool, device, dtype) -> None:
        super().__init__()
        self.glu = glu
        self.up = nn.Linear(hidden, 2 * ffn if glu else ffn, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, device=device, dtype=dtype)
        self.ffn = ffn

    def forward(self, x):
        h = self.up(x)
        if self.glu:
            gate, up = h.split(self.ffn, -1)
            h = nn.functional.silu(gate) * up
        else:
            h = nn.functional.gelu(h, approximate="tanh")
        return self.down(h)


def timed(fn, x, repeats: int, device: str) -> tuple[list[float], list[float]]:
    """Wall-clock and process-CPU seconds of ``repeats`` forward+backward steps."""
    wall, cpu = [], []
    for _ in range(repeats):
        x.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn(x)
        y = out[0] if isinstance(out, tuple) else out
        y.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def grouped_gemm_ways(offsets: torch.Tensor) -> dict:
    """Each way of computing ``c[rows of e] = a[rows of e] @ b[e]`` (``b`` may be strided) and its weight gradient."""
    import torch.nn.functional as F

    from smalti.moe import reference

    bounds = [0, *offsets.tolist()]
    offs32 = offsets.to(torch.int32)

    def loop(a, b):
        out = a.new_empty(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
            torch.mm(a[s:t], b[e], out=out[s:t])
        return out

    def loop_wgrad(a, dc):
        out = a.new_empty(len(bounds) - 1, a.shape[1], dc.shape[1])
        for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
            torch.mm(a[s:t].t(), dc[s:t], out=out[e])
        return out

    def padded(a):
        rows = max(t - s for s, t in zip(bounds, bounds[1:]))
        out = a.new_zeros(len(bounds) - 1, rows, a.shape[1])
        for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
            out[e, : t - s] = a[s:t]
        return out

    def unpad(c):
        return torch.cat([c[e, : t - s] for e, (s, t) in enumerate(zip(bounds, bounds[1:]))])

    ways = {
        "smalti (torch backend)": (lambda a, b: reference.grouped_mm(a, b, offsets),
                                   lambda a, dc: reference.grouped_mm_wgrad(a, dc, offsets)),
        "loop of torch.mm": (loop, loop_wgrad),
        "F.grouped_mm": (lambda a, b: F.grouped_mm(a, b, offs=offs32),
                         lambda a, dc: F.grouped_mm(a.t(), dc, offs=offs32)),
        "torch._grouped_mm": (lambda a, b: torch._grouped_mm(a, b, offs=offs32),
                              lambda a, dc: torch._grouped_mm(a.t(), dc, offs=offs32)),
        "padded bmm": (lambda a, b: unpad(torch.bmm(padded(a), b)),
                       lambda a, dc: torch.bmm(padded(a).transpose(1, 2), padded(dc))),
    }
    matmul_into = _openblas_matmul_into()
    if matmul_into is not None:  # what smalti-llm installs on CPUs where smalti-core's cpu_gemm picks OpenBLAS
        from smalti.moe.cpu_matmul import cpu_matmul

        def through(fn):
            def run(*operands):
                with cpu_matmul(matmul_into):
                    return fn(*operands)
            return run

        ways["smalti (openblas)"] = (through(ways["smalti (torch backend)"][0]),
                                     through(ways["smalti (torch backend)"][1]))
    return ways


def _openblas_matmul_into():
    """smalti-core's ``cpu_gemm.matmul_into`` with its OpenBLAS backend on, or ``None`` (said why) where it cannot be."""
    try:
        from smalti.core import cpu_gemm
        from smalti.core.errors import ConfigError
    except ImportError as exc:
        print(f"no openblas column: {exc}")
        return None
    try:
        cpu_gemm.configure_cpu_gemm("openblas", "cpu")
    except ConfigError as exc:
        print(f"no openblas column: {exc}")
        return None
    return cpu_gemm.matmul_into


# (case, grouped call given a way's (product, weight gradient) and the operands, the dense yardstick)
GEMM_CASES = (
    ("forward", lambda f, g, t: f(t["x"], t["w"]), lambda t: t["x"] @ t["w"][0]),
    ("input grad", lambda f, g, t: f(t["dc"], t["w"].transpose(1, 2)), lambda t: t["dc"] @ t["w"][0].t()),
    ("weight grad", lambda f, g, t: g(t["x"], t["dc"]), lambda t: t["x"].t() @ t["dc"]),
)


def gemm_bench(a: argparse.Namespace) -> None:
    """Time every way of :func:`grouped_gemm_ways` on the layer's two projections, forward and backward."""
    torch.manual_seed(0)
    rows, expert_ffn = a.tokens * a.top_k, a.ffn // a.top_k
    ids = torch.randint(0, a.experts, (rows,))
    offsets = torch.cumsum(torch.bincount(ids, minlength=a.experts), 0)
    up = 2 * expert_ffn if a.mlp_type == "glu" else expert_ffn
    print(f"grouped GEMM on cpu, float32, {rows} rows ({a.tokens} tokens top-{a.top_k}) over {a.experts} experts "
          f"(largest {int(torch.bincount(ids).max())}), {torch.get_num_threads()} threads; "
          "process CPU ms per call (best of {}), GFLOP/s".format(a.repeats))
    ways = grouped_gemm_ways(offsets)
    for name, k, m in (("w1", a.hidden, up), ("w2", expert_ffn, a.hidden)):
        t = {"x": torch.randn(rows, k), "w": torch.randn(a.experts, k, m), "dc": torch.randn(rows, m)}
        flops = 2 * rows * k * m
        for case, call, dense in GEMM_CASES:
            cells = [f"dense mm {_cpu_ms(lambda: dense(t), a.repeats):7.1f}"]  # noqa: B023
            for name_, fns in ways.items():
                ms = _cpu_ms(lambda: call(*fns, t), a.repeats)  # noqa: B023 (timed before the loop moves on)
                cells.append(f"{name_} {ms:7.1f} ({flops / ms / 1e6:4.1f})")
            print(f"{name} [{rows}x{k}]@[{a.experts}x{k}x{m}] {case:11s}: " + " | ".join(cells))


def _cpu_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048, help="dense FFN hidden size; each expert gets ffn / top_k")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--mlp-type", default="glu", choices=["mlp", "glu"])
    p.add_argument("--backend", default="torch", choices=["torch", "triton"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", choices=["dbrx"], help="dbrx: DBRX-like shapes, triton backend, bf16 on CUDA")
    p.add_argument("--threads", type=int, help="torch.set_num_threads on CPU (default: torch's choice)")
    p.add_argument("--gemm", action="store_true", help="time the grouped GEMM's ways instead of the layer (CPU)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.gemm:
        gemm_bench(a)
        return
    if a.preset == "dbrx":
        a.experts, a.top_k, a.hidden, a.ffn, a.tokens = 16, 4, 6144, 4 * 10752, 8192
        a.backend, a.device, a.dtype, a.mlp_type = "triton", "cuda", "bfloat16", "glu"
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    glu = a.mlp_type == "glu"
    dense = DenseFFN(a.hidden, a.ffn, glu, a.device, dtype)
    moe = MoE(hidden_size=a.hidden, ffn_hidden_size=a.ffn // a.top_k, num_experts=a.experts, top_k=a.top_k,
              mlp_type=a.mlp_type, activation="silu" if glu else "gelu", backend=a.backend, device=a.device,
              dtype=dtype)
    x = torch.randn(a.tokens, a.hidden, device=a.device, dtype=dtype, requires_grad=True)
    timed(dense, x, 2, a.device)
    timed(moe, x, 2, a.device)
    d_times, m_times, d_cpu, m_cpu = [], [], [], []
    for _ in range(a.rounds):
        wall, cpu = timed(dense, x, a.repeats, a.device)
        d_times, d_cpu = d_times + wall, d_cpu + cpu
        wall, cpu = timed(moe, x, a.repeats, a.device)
        m_times, m_cpu = m_times + wall, m_cpu + cpu
    d, m = statistics.median(d_times), statistics.median(m_times)
    d_best, m_best = min(d_times), min(m_times)
    print(f"device {a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}), {a.dtype}, "
          f"{a.tokens} tokens, hidden {a.hidden}, {a.experts} experts top-{a.top_k}, expert ffn {a.ffn // a.top_k}, "
          f"{a.mlp_type}, backend {a.backend}")
    print(f"dense FFN (ffn {a.ffn})  fwd+bwd median {d * 1e3:8.2f} ms   {a.tokens / d:12.0f} tokens/s")
    print(f"dropless MoE            fwd+bwd median {m * 1e3:8.2f} ms   {a.tokens / m:12.0f} tokens/s")
    print(f"ratio moe / dense = {m / d:.3f} (median), {m_best / d_best:.3f} (best of {len(m_times)})")
    if a.device == "cpu":  # on a shared machine, process CPU time is steadier than wall time
        dc, mc = statistics.median(d_cpu), statistics.median(m_cpu)
        print(f"CPU time per step: dense {dc * 1e3:.1f} ms, moe {mc * 1e3:.1f} ms, ratio {mc / dc:.3f} "
              f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
