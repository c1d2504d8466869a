"""``python -m smalti.moe.aot``: the Triton kernels compiled for real GPUs (sm_90 here) on a machine without one.

The compiling tests run the command in a child process with a fresh Triton cache, so every kernel really goes
through Triton's CUDA backend and the ptxas shipped with Triton. They compile the heaviest configuration of
each kernel (``--sample``) to stay near half a minute; the full table (every autotune config, both targets,
all dtypes) is the command's default and is in the README.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from smalti.moe import aot  # noqa: E402

DBRX_YAML = Path(__file__).resolve().parents[2] / "llm" / "src" / "smalti" / "llm" / "conf" / "model" / "moe_dbrx_like.yaml"


def run_aot(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "smalti.moe.aot", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def table_rows(stdout: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| sm_")]
    assert rows, stdout
    return rows


@pytest.mark.timeout(300)
def test_every_kernel_compiles_for_sm90_bf16(tmp_path):
    proc = run_aot(tmp_path, "--target", "sm_90", "--dtype", "bf16", "--sample", "--jobs", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = table_rows(proc.stdout)
    assert sorted({r[2] for r in rows}) == sorted(aot.kernels())
    assert len(rows) == len(aot.kernels())  # one (the heaviest) configuration per kernel
    for target, _dtype, kernel, _site, _config, regs, spill, shared, verdict in rows:
        assert target == "sm_90" and verdict == "ok", rows
        assert 0 < int(regs) <= 255 and int(spill) == 0 and 0 <= int(shared) <= 232448, (kernel, regs, spill, shared)
    gemm = next(r for r in rows if r[2] == "_grouped_mm_kernel")
    assert int(gemm[7]) > 0  # a pipelined GEMM stages its tiles in shared memory


@pytest.mark.timeout(300)
def test_a_config_needing_too_much_shared_memory_fails(tmp_path):
    # 64x512 and 512x64 bf16 tiles (64 KiB each) in 4 stages: far beyond sm_90's 227 KiB per block.
    proc = run_aot(tmp_path, "--target", "sm_90", "--dtype", "bf16", "--kernel", "_wgrad_kernel", "--sample",
                   "--config", "_wgrad_kernel:BLOCK_K=64,BLOCK_N=64,BLOCK_R=512,num_warps=4,num_stages=4")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    (row,) = table_rows(proc.stdout)
    assert "BLOCK_R=512" in row[4]
    assert int(row[7]) > 232448
    assert re.search(r"FAIL: .*shared memory \d+ > 232448", row[8]), row


def test_scenarios_launch_every_kernel_forward_and_both_backward_gemms():
    import torch

    launches = aot.record(torch.bfloat16)
    assert {launch.kernel for launch in launches} == set(aot.kernels())
    sites = {launch.site for launch in launches}
    # forward GEMMs, the input-gradient GEMMs (through the transposed weights) and the weight-gradient GEMM
    assert {"gather_mm fwd", "mm_scatter fwd", "gather_mm bwd", "mm_scatter bwd", "grouped_mm_wgrad bwd",
            "glu fwd", "glu_backward bwd", "sort_by_expert fwd"} <= sites
    cases = aot.expand(launches)
    gemm_configs = {c.describe() for c in cases if c.kernel == "_grouped_mm_kernel"}
    # {gather, scatter, plain} x {w, w^T} x each of the 4 autotune configs for 16-bit operands
    assert len(gemm_configs) == 6 * 4
    fp32 = {c.describe() for c in aot.expand(aot.record(torch.float32)) if c.kernel == "_grouped_mm_kernel"}
    assert len(fp32) == 6 * 2 and all("BLOCK_N=256" not in d for d in fp32)  # fp32's own, smaller tiles
    acts = {dict(c.constexprs)["ACT"] for c in cases if c.kernel == "_glu_kernel"}
    assert acts == {0, 1, 2}  # silu, gelu, relu


def test_bad_target_is_refused_naming_the_choices(capsys):
    assert aot.main(["--target", "sm_75", "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "sm_75" in err and "sm_80" in err and "sm_90" in err


@pytest.mark.skipif(not DBRX_YAML.exists(), reason="smalti-llm's configs are not in this checkout")
def test_shapes_are_the_dbrx_like_model():
    import yaml
    model = yaml.safe_load(DBRX_YAML.read_text())
    assert aot.DBRX_LIKE["hidden_size"] == model["d_model"]
    assert aot.DBRX_LIKE["ffn_hidden_size"] == model["ffn_hidden_size"]
    assert aot.DBRX_LIKE["num_experts"] == model["moe"]["num_experts"]
    assert aot.DBRX_LIKE["top_k"] == model["moe"]["top_k"]
    assert aot.DBRX_LIKE["tokens"] % model["max_seq_len"] == 0
