"""Matmul compute check: achieved FLOP/s, the GPU peak table, and the comparison with peers on 2 ranks."""

import pytest
import torch

from smalti.health.compute import measure_matmul_flops, peak_flops_for, run_compute_check
from smalti.health.results import Verdict


def test_cpu_reports_achieved_flops_only():
    result = run_compute_check("cpu", size=256, seconds=0.2)
    assert result.verdict is Verdict.OK and result.name == "compute/rank0"
    assert result.metrics["health/compute/tflops"] > 0
    assert "health/compute/fraction_of_peak" not in result.metrics  # a CPU has no peak in the table
    assert "TFLOP/s" in result.message and "cpu" in result.message


def test_measured_flops_count_two_flops_per_multiply_add():
    # At least one 128^3 matmul a second, and none in under a microsecond (4 TFLOP/s: beyond 2 CPU cores).
    flops = measure_matmul_flops(torch.device("cpu"), 128, 0.05, torch.float32)
    assert 2 * 128**3 / 1.0 < flops < 2 * 128**3 / 1e-6


def test_known_gpus_have_a_bf16_peak_and_unknown_ones_none():
    h100, h200, a100 = (peak_flops_for(n, torch.bfloat16) for n in
                        ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"))
    assert h100 and h200 and a100
    assert h100 == h200 > a100 > 1e14  # H200 has the H100 SXM tensor cores; A100 bf16 is ~312 TFLOP/s
    assert peak_flops_for("Some Future Accelerator", torch.bfloat16) is None


@pytest.mark.world_size(2)
def test_ranks_compare_with_the_median_of_their_peers():
    import torch.distributed as dist

    lenient = run_compute_check("cpu", size=128, seconds=0.1, min_fraction_of_median=0.0)
    assert lenient.verdict is Verdict.OK and lenient.name == f"compute/rank{dist.get_rank()}"
    assert lenient.metrics["health/compute/fraction_of_median"] > 0
    # Of two ranks the median is the faster one, so no rank reaches 1.5x of it: both must fail.
    strict = run_compute_check("cpu", size=128, seconds=0.1, min_fraction_of_median=1.5)
    assert strict.verdict is Verdict.FAIL and "x the median rank's" in strict.message


def test_the_check_leaves_the_global_random_stream_alone():
    """It runs mid-training (the MFU alarm): drawing from torch's global generator would shift dropout and
    router jitter from the point it fires, and a resumed run would no longer match."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    measure_matmul_flops(torch.device("cpu"), 32, 0.01, torch.float32)
    assert torch.equal(torch.get_rng_state(), before)
