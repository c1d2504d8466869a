"""``bench/moe_vs_hf.py`` at a tiny shape: both sides train the same Mixtral folder at the same precision with
fused AdamW, their first losses (load-balancing term included) agree to 1e-4 relative, and the last line is
``moe_vs_hf: speed X.XX memory X.XX``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parent.parent / "bench" / "moe_vs_hf.py"
TINY = ["--vocab", "256", "--d-model", "32", "--ffn", "48", "--experts", "4", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--seq", "32", "--batch", "2", "--steps", "2"]


def test_tiny_run_compares_on_equal_terms_and_ends_with_the_ratios(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH), *TINY, "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    hf, sm = result["results"]["hf"], result["results"]["smalti"]
    assert hf["terms"] == sm["terms"] == {"precision": "fp32", "adamw": "fused"}
    assert hf["experts"] == "experts_implementation=grouped_mm"  # transformers 5.24 default
    assert abs(sm["losses"][0] - hf["losses"][0]) <= 1e-4 * abs(hf["losses"][0])
    assert sm["losses"][1] < sm["losses"][0] + 1.0 and len(sm["losses"]) == 2
    # the product smalti's experts ran on is named, and it is smalti-core's CPU GEMM backend
    assert sm["cpu_gemm"] in ("openblas", "torch") and f"expert products on {sm['cpu_gemm']}" in sm["experts"]
    ratio = done.stdout.strip().splitlines()[-2]
    assert ratio.startswith("tokens per CPU second") and f"smalti's CPU GEMM backend: {sm['cpu_gemm']}" in ratio
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"moe_vs_hf: speed \d+\.\d\d memory \d+\.\d\d", last), last
