"""``bench/sft_vs_trl.py`` compares smalti's chat finetune with TRL's SFTTrainer on the same terms.

At a tiny shape, under ``--precision amp_bf16`` and ``--precision fp32``, both sides must have trained at that
precision (bf16 autocast, or none at all) with fused AdamW, both checkpointing activations
(TRL's default), on the same assistant tokens of the same shipped heavy-tailed chat data, and reach held-out losses
within 2%; the last line is the one the README quotes. The fp32 run takes its sides one process at a time
(``--sides``) and joins their ``--json`` files (``--from``), as a run at a real shape does; a join of runs on
other terms is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
BENCH = Path(__file__).resolve().parent.parent / "bench" / "sft_vs_trl.py"


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), "--shape", "tiny", "--conversations", "16", "--eval-conversations", "4",
         "--max-len", "128", *args],
        capture_output=True, text=True, timeout=1200, check=False, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.timeout(1800)  # up to five processes that each import torch, transformers and TRL: minutes on a loaded CPU
@pytest.mark.parametrize(("precision", "autocast", "bf16"), [("amp_bf16", "bfloat16", True), ("fp32", "off", False)])
def test_both_sides_train_the_same_tokens_at_the_same_precision_and_optimizer(tmp_path, precision, autocast, bf16):
    out = tmp_path / "result.json"
    if precision == "amp_bf16":
        done = _bench(tmp_path, "--precision", precision, "--json", str(out))
    else:  # each side in its own run, then joined
        for side in ("trl", "smalti"):
            alone = _bench(tmp_path, "--precision", precision, "--sides", side, "--json", str(tmp_path / f"{side}.json"))
            assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-3000:]
            assert list(json.loads((tmp_path / f"{side}.json").read_text())["sides"]) == [side]
            assert alone.stdout.strip().splitlines()[-1].startswith("sft_vs_trl: no ratio")
        files = [str(tmp_path / "trl.json"), str(tmp_path / "smalti.json")]
        refused = _bench(tmp_path, "--precision", precision, "--lr", "2e-4", "--from", *files)
        assert refused.returncode != 0 and "--from" in refused.stderr and "trl.json" in refused.stderr, refused.stderr
        done = _bench(tmp_path, "--precision", precision, "--from", *files, "--json", str(out))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "trl: from" in done.stdout and "smalti: from" in done.stdout
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
    assert sm["steps"] == trl["steps"]  # the same learning-rate schedule
    # one conversation per row (TRL leaves out those whose assistant turns the truncation cut): no packing
    assert trl["rows"] <= 16 and trl["steps"] == -(-trl["rows"] // 8)
    assert abs(sm["eval_loss"] - trl["eval_loss"]) / trl["eval_loss"] < 0.02
    assert "trl 1.16.0" in result["baseline"] and "adamw_torch_fused" in result["baseline"]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"sft_vs_trl: default speed \d+\.\d\d memory \d+\.\d\d packed not run \(--packed\)", last), last


def test_smalti_takes_as_many_optimizer_steps_as_trls_default_collator():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("sft_vs_trl_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # (packed rows, conversations): the 1B-like run's 7 rows of 16 conversations, and others
    for rows, conversations in [(7, 16), (2, 16), (30, 16), (9, 40), (5, 5), (150, 400)]:
        per_batch = bench.smalti_batch_rows(rows, conversations)
        assert -(-rows // per_batch) == -(-conversations // bench.TRL_BATCH), (rows, conversations, per_batch)
