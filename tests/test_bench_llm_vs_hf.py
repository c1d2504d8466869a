"""``bench/llm_vs_hf.py`` compares smalti with transformers on the same terms.

At a tiny shape (smalti checkpointing blocks) the bench must run both sides under the same autocast (bf16 by default) with the same AdamW
implementation (fused, as ``optim="adamw_torch_fused"``), transformers with SDPA and gradient checkpointing, and the two first losses must
agree to 1e-4 relative; its last line is the worst same-precision ratio.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "llm_vs_hf.py"
TINY = [
    "--vocab",
    "256",
    "--d-model",
    "32",
    "--ffn",
    "96",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--seq",
    "32",
    "--batch",
    "2",
    "--steps",
    "2",
]


def _run(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH), *TINY, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_both_sides_train_at_the_same_precision_with_the_same_optimizer(tmp_path):
    """One tiny run with smalti checkpointing blocks: transformers must checkpoint too."""
    result, stdout = _run(tmp_path, "--ac", "block")
    (shape,) = result["shapes"]
    hf, sm = shape["terms"]["hf"], shape["terms"]["smalti"]
    assert hf["autocast"] == sm["autocast"] == ["bfloat16"], shape["terms"]
    assert hf["optimizer"] == sm["optimizer"] == "fused", shape["terms"]
    assert hf["attention"] == "sdpa"
    assert hf["checkpointing"] is sm["checkpointing"] is True, shape["terms"]
    losses = shape["first_losses"]
    first_hf, first_sm = losses["hf amp_bf16"], losses["smalti amp_bf16"]
    assert abs(first_sm - first_hf) / abs(first_hf) < 1e-4, losses
    assert "transformers" in result["baseline"] and "AdamW(fused)" in result["baseline"]
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"llm_vs_hf: worst speed \d+\.\d\d worst memory \d+\.\d\d \(same precision\)", last
    ), last
