"""``bench/lora.py`` at a tiny shape: full finetuning, LoRA, QLoRA and transformers+PEFT all run under bf16 autocast
with fused AdamW, LoRA trains the same number of adapter parameters as PEFT with the same first loss, and the
last line carries every ratio."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "lora.py"
TINY = ["--vocab", "256", "--d-model", "64", "--ffn", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--seq", "32", "--batch", "2", "--steps", "2"]


@pytest.mark.timeout(900)
def test_lora_bench_runs_every_side_on_the_same_terms(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    pytest.importorskip("smalti.checkpoint")
    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH), *TINY, "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"lora: mem_vs_full \d+\.\d\d qlora_mem_vs_full \d+\.\d\d vs_peft_speed \d+\.\d\d "
                        r"vs_peft_memory \d+\.\d\d ckpt_ratio \d+\.\d\d", last), last
    runs = json.loads(out.read_text())["runs"]
    for side in ("full", "lora", "qlora", "peft"):
        assert runs[side]["autocast"] == ["bfloat16"], side
        assert runs[side]["optimizer"] == "fused", side
    assert runs["peft"]["adapter_dtypes"] == ["torch.float32"]
    assert runs["lora"]["trainable"] == runs["peft"]["trainable"] == runs["qlora"]["trainable"]
    assert runs["full"]["trainable"] > 3 * runs["lora"]["trainable"]
    # the same model and data: PEFT's first loss (its bf16 base) equals smalti's LoRA's within bf16's rounding
    assert abs(runs["lora"]["losses"][0] - runs["peft"]["losses"][0]) < 1e-2 * runs["peft"]["losses"][0]
    assert runs["lora"]["ckpt_bytes"] < runs["full"]["ckpt_bytes"]
