"""bf16 where it matters: ``experiment=gpt_tiny`` and ``experiment=moe_tiny`` train end to end on the CPU under
``trainer.precision=amp_bf16`` (CPU autocast to bf16) with FSDP2's bf16 parameter policy
(``parallelism=fsdp_bf16``: bf16 weights gathered per block, fp32 gradient reduction) on 2 gloo ranks, and
their losses stay finite and close to the same run in fp32 (``parallelism=fsdp``, ``trainer.precision=fp32``).

Tolerance, 1e-3 relative per step. Both runs start from the same seed and weights, so the losses differ only by
bf16 rounding inside the step (8 mantissa bits, 2**-9 ~ 2e-3 relative per element) and its effect on the
first few updates at the warm-up's small learning rate. At initialisation the logits are small and the loss
(~log 2048 = 7.6) is an average over 8 x 128 tokens, so that rounding largely cancels: measured on this CPU,
at most 1.1e-5 (gpt_tiny) and 4.6e-5 (moe_tiny) over the 3 steps. 1e-3 leaves 20x room for other CPUs'
kernels, yet catches a loss computed or reduced in bf16 (one bf16 ulp at 7.6 is 0.03, 4e-3 relative) and
anything that loses the fp32 master weights or overflows. The losses must also differ from fp32's: bit-equal
losses would mean neither autocast nor the bf16 parameter policy took effect.

The four runs (two experiments, two precisions) train one after another in the same 2-rank torchrun launch: each
is composed and built as ``smalti-train`` builds it, from its own seed, so a run's losses do not depend on the
runs before it; one launch saves three interpreter starts per rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from smalti.testing.torchrun import run_process_group, torchrun_command  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
REL_TOL = 1e-3

# The experiments' extra callbacks (ICL at fit end, MLflow model registry) are not what this test is about.
EXPERIMENTS = {
    "gpt_tiny": ["callbacks.icl=null", "callbacks.mlflow_model=null"],
    "moe_tiny": ["callbacks.mlflow_model=null"],
}
PRECISIONS = {
    "fp32": ["parallelism=fsdp", "trainer.precision=fp32"],
    "bf16": ["parallelism=fsdp_bf16", "trainer.precision=amp_bf16"],
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict[tuple[str, str], list[float]]:
    """Every (experiment, precision) run's losses per step, all trained one after another in one 2-rank torchrun
    launch (tests/fixtures/train_in_sequence.py: one interpreter start and process group for the four runs)."""
    out = tmp_path_factory.mktemp("bf16")
    runs = {f"{experiment}-{precision}": [f"experiment={experiment}", f"trainer.max_duration={STEPS}ba",
                                          "trainer.eval_interval=null", "data.global_train_batch_size=8",
                                          *EXPERIMENTS[experiment], *PRECISIONS[precision]]
            for experiment in sorted(EXPERIMENTS) for precision in PRECISIONS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun_command(2), str(ROOT / "tests" / "fixtures" / "train_in_sequence.py"), str(out), json.dumps(runs)]
    proc = run_process_group(cmd, env=env, timeout=600, cwd=out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    from smalti.core.loggers import read_jsonl

    found = {}
    for name in runs:
        by_step = {r["step"]: r["metrics"]["loss/train/total"] for r in read_jsonl(out / name / "metrics.jsonl")
                   if "loss/train/total" in r.get("metrics", {})}
        assert sorted(by_step) == list(range(1, STEPS + 1)), (name, by_step)
        experiment, precision = name.rsplit("-", 1)
        found[experiment, precision] = [by_step[s] for s in sorted(by_step)]
    return found


@pytest.mark.timeout(700)
@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_bf16_autocast_with_fsdp2_bf16_params_matches_fp32(losses, experiment):
    fp32, bf16 = losses[experiment, "fp32"], losses[experiment, "bf16"]
    assert all(math.isfinite(x) for x in bf16), bf16
    assert bf16 == pytest.approx(fp32, rel=REL_TOL), (bf16, fp32)
    assert bf16 != fp32, "bf16 losses equal fp32's bit for bit: bf16 autocast/parameters were not applied"
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0], (fp32, bf16)  # both train
    print(f"{experiment}: fp32 {fp32}, bf16 {bf16}, max rel diff "
          f"{max(abs(b - f) / abs(f) for b, f in zip(bf16, fp32)):.2e}", file=sys.stderr)
