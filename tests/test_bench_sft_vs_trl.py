"""``bench/sft_vs_trl.py`` compares smalti's chat finetune with TRL's SFTTrainer on the same terms.

At a tiny shape, under ``--precision amp_bf16`` and ``--precision fp32``, both sides must have trained at that
precision (bf16 autocast, or none at all) with fused AdamW, both checkpointing activations
(TRL's default), on the same assistant tokens of the same shipped heavy-tailed chat data, and reach held-out losses
within 2%; the last line is the one the README quotes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
BENCH = Path(__file__).resolve().parent.parent / "bench" / "sft_vs_trl.py"


@pytest.mark.timeout(900)  # three processes that each import torch, transformers and TRL: minutes on a loaded CPU
@pytest.mark.parametrize(("precision", "autocast", "bf16"), [("amp_bf16", "bfloat16", True), ("fp32", "off", False)])
def test_both_sides_train_the_same_tokens_at_the_same_precision_and_optimizer(tmp_path, precision, autocast, bf16):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--shape", "tiny", "--conversations", "16", "--eval-conversations", "4",
         "--max-len", "128", "--precision", precision, "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    trl, sm = result["sides"]["trl"], result["sides"]["smalti"]
    assert trl["autocast"] == sm["autocast"] == [autocast], (trl["autocast"], sm["autocast"])
    assert sm["precision"] == result["precision"] == precision
    assert f"precision {precision} (bf16={bf16}" in result["baseline"]
    assert trl["optimizer"] == sm["optimizer"] == "fused"
    assert trl["checkpointing"] is sm["checkpointing"] is True
    assert trl["collator"] == "DataCollatorForLanguageModeling" and not trl["padding_free"]
    assert trl["assistant_tokens"] == sm["assistant_tokens"] > 0
    # one conversation per row (TRL leaves out those whose assistant turns the truncation cut): no packing
    assert trl["rows"] <= 16 and trl["steps"] == -(-trl["rows"] // 8)
    assert abs(sm["eval_loss"] - trl["eval_loss"]) / trl["eval_loss"] < 0.02
    assert "trl 1.16.0" in result["baseline"] and "adamw_torch_fused" in result["baseline"]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"sft_vs_trl: default speed \d+\.\d\d memory \d+\.\d\d packed not run \(--packed\)", last), last
