"""``smalti plan`` for ``precision=fp8``: the float8 share of the GEMMs runs at H100's fp8 peak, the step is
compared with amp_bf16 at the same layout, and a GPU without FP8 is refused."""

import pytest

from smalti.core.errors import ConfigError
from smalti.core.plan.report import format_plan, make_plan

LAYOUT = ["experiment=llama3_8b", "parallelism=fsdp", "plan.gpu=h100", "plan.gpus=8"]


def test_llama3_8b_fp8_on_8_h100s_is_faster_than_bf16_in_the_same_memory():
    bf16 = make_plan([*LAYOUT, "precision=amp_bf16"])
    fp8 = make_plan([*LAYOUT, "precision=fp8"])
    speedup = bf16.step.step_s / fp8.step.step_s
    # Not 2x: attention and the head stay in bf16, and the all-gathers shrink by less than half.
    assert 1.2 < speedup < 2.0
    assert fp8.peak == bf16.peak
    text = format_plan(fp8)
    assert f"fp8 against amp_bf16 at this layout: step {fp8.step.step_s:.3f} s against {bf16.step.step_s:.3f} s" in text
    assert "of the FLOPs (the float8 linear layers' GEMMs) at the fp8 dense peak (1,978.9 TFLOP/s)" in text


def test_keeping_more_layers_in_bf16_lowers_the_gain():
    default = make_plan([*LAYOUT, "precision=fp8"])
    fewer = make_plan([*LAYOUT, "precision=fp8", "algorithms=[float8]", "algorithms.float8.skip=[lm_head,'*.ffn.*']"])
    assert fewer.step.step_s > default.step.step_s


def test_a100_has_no_fp8():
    with pytest.raises(ConfigError, match="plan.gpu=a100 has no FP8 tensor cores"):
        make_plan(["experiment=llama3_8b", "parallelism=fsdp", "plan.gpu=a100", "plan.gpus=8", "precision=fp8"])
