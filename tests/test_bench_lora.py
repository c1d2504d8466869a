"""``bench/lora.py`` at a tiny shape: full finetuning, LoRA and QLoRA on token batches, then smalti's LoRA run
against TRL + PEFT on heavy-tailed chat data, every side at the precision asked for (fp32: fp32 base and
adapters, no autocast) with fused AdamW, LoRA training as many adapter parameters as PEFT on the same assistant
tokens; the last line carries every ratio; workers that ran on different terms get no ratio."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "lora.py"
TINY = ["--vocab", "512", "--d-model", "64", "--ffn", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--seq", "32", "--batch", "2", "--steps", "2", "--conversations", "12", "--max-len", "256"]


def _bench():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("lora_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)
def test_lora_bench_runs_every_side_in_fp32_on_the_same_terms(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    pytest.importorskip("torchao")
    pytest.importorskip("smalti.checkpoint")
    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH), *TINY, "--precision", "fp32", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=850, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"lora: mem_vs_full \d+\.\d\d qlora_mem_vs_full \d+\.\d\d vs_peft_speed \d+\.\d\d "
                        r"vs_peft_memory \d+\.\d\d ckpt_ratio \d+\.\d\d", last), last
    result = json.loads(out.read_text())
    runs, chat = result["runs"], result["chat"]
    assert result["precision"] == "fp32"
    for name, run in {**runs, **chat}.items():
        assert run["precision"] == "fp32" and run["autocast"] == ["off"], name
        assert run["optimizer"] == "fused", name
    assert runs["lora"]["base_dtypes"] == ["torch.float32"]  # fp32 base, not bf16, under an fp32 run
    assert "NF4Tensor" in runs["qlora"]["base_dtypes"]
    assert runs["lora"]["trainable"] == runs["qlora"]["trainable"]
    assert runs["full"]["trainable"] > 3 * runs["lora"]["trainable"]
    assert runs["lora"]["losses"][0] == pytest.approx(runs["full"]["losses"][0], rel=1e-4)  # adapters start at 0
    assert runs["lora"]["ckpt_bytes"] < runs["full"]["ckpt_bytes"]
    # the chat workload: the same adapters on the same assistant tokens, PEFT padding per batch, smalti packing
    assert chat["smalti"]["trainable"] == chat["peft"]["trainable"] == runs["lora"]["trainable"]
    assert chat["smalti"]["assistant_tokens"] == chat["peft"]["assistant_tokens"] > 0
    assert chat["peft"]["collator"] == "DataCollatorForLanguageModeling"
    assert chat["smalti"]["checkpointing"] is chat["peft"]["checkpointing"] is True


def test_lora_bench_refuses_ratios_across_precisions():
    bench = _bench()
    same = {"a": {"precision": "fp32", "autocast": ["off"]}, "b": {"precision": "fp32", "autocast": ["off"]}}
    bench._same_terms(same, ("precision", "autocast"))
    mixed = {**same, "b": {"precision": "amp_bf16", "autocast": ["bfloat16"]}}
    with pytest.raises(SystemExit, match="same terms"):
        bench._same_terms(mixed, ("precision", "autocast"))
