"""``bench/lora.py`` at a tiny shape: full finetuning, LoRA and QLoRA on token batches, then smalti's LoRA run
against TRL + PEFT on heavy-tailed chat data, every side at the precision asked for (fp32: fp32 products and
adapters, no autocast; LoRA's base in the recipe's bf16 against full finetuning, fp32 as PEFT's in the chat part) with fused AdamW, LoRA training as many adapter parameters as PEFT on the same assistant
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
    # the recipe's bf16 base (its matrices; the 1-D norm scales stay fp32), upcast for each product under fp32
    assert runs["lora"]["base_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert "NF4Tensor" in runs["qlora"]["base_dtypes"]
    assert runs["lora"]["trainable"] == runs["qlora"]["trainable"]
    assert runs["full"]["trainable"] > 3 * runs["lora"]["trainable"]
    # adapters start at 0: the base's loss, with the base rounded to bf16
    assert runs["lora"]["losses"][0] == pytest.approx(runs["full"]["losses"][0], rel=1e-2)
    assert runs["lora"]["ckpt_bytes"] < runs["full"]["ckpt_bytes"]
    # the chat workload: the same adapters on the same assistant tokens, PEFT padding per batch, smalti packing
    assert chat["smalti"]["trainable"] == chat["peft"]["trainable"] == runs["lora"]["trainable"]
    assert chat["smalti"]["assistant_tokens"] == chat["peft"]["assistant_tokens"] > 0
    assert chat["smalti"]["steps"] == chat["peft"]["steps"], "smalti's batches give another number of optimizer steps"
    assert chat["peft"]["collator"] == "DataCollatorForLanguageModeling"
    assert chat["smalti"]["checkpointing"] is chat["peft"]["checkpointing"] is True


def test_lora_bench_refuses_ratios_across_precisions():
    bench = _bench()
    same = {"a": {"precision": "fp32", "autocast": ["off"]}, "b": {"precision": "fp32", "autocast": ["off"]}}
    bench._same_terms(same, ("precision", "autocast"))
    mixed = {**same, "b": {"precision": "amp_bf16", "autocast": ["bfloat16"]}}
    with pytest.raises(SystemExit, match="same terms"):
        bench._same_terms(mixed, ("precision", "autocast"))


@pytest.mark.timeout(900)
def test_timed_saves_time_every_save_and_count_only_adapter_entries(tmp_path, monkeypatch):
    """Both sides' saves go through ``timed_saves``: every save timed, and a LoRA model's checkpoint holds
    entries for its adapters (and their AdamW state) only, never the frozen base's tensors."""
    pytest.importorskip("smalti.checkpoint")
    import torch

    from smalti.core import Trainer
    from smalti.llm import LLM

    monkeypatch.chdir(tmp_path)
    bench = _bench()
    entries = {}
    for side, lora in (("full", None), ("lora", {"r": 2, "targets": ["q", "v"], "base_dtype": "float32"})):
        torch.manual_seed(0)
        model = LLM(d_model=32, n_heads=4, n_layers=2, vocab_size=64, ffn_type="glu", max_seq_len=16, lora=lora)
        batches = [{"input_ids": torch.randint(0, 64, (2, 16))}]
        trainer = Trainer(model, batches, "1ba", eval_interval=None, precision="fp32",
                          optimizers=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad]))
        trainer.fit()
        out = bench.timed_saves(trainer, saves=2)
        assert out["ckpt_s"] > 0 and len(out["ckpt_s_later"]) == 1 and out["ckpt_bytes"] > 0
        tensors = {n for n, p in model.named_parameters() if p.requires_grad}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        entries[side] = (out["ckpt_entries"], tensors, frozen)
    count, adapters, frozen = entries["lora"]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters) and frozen
    # full finetuning: every parameter with its state; LoRA: fewer entries, by (at least) the frozen parameters
    assert count < entries["full"][0] - len(frozen)
    line = bench.save_time_line({"ckpt_s": 1.0, "ckpt_s_later": [0.5, 0.3]}, {"ckpt_s": 4.0, "ckpt_s_later": [2.0]})
    assert line.endswith("= 0.250; later saves 0.400 s / 2.000 s = 0.200"), line
