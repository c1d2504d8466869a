"""What a training process imports: a step of smalti's LLM, without evaluation, loads neither torchmetrics nor
``transformers`` (which torchmetrics imports when it is installed: ~270 MB of RSS in every training process,
a sixth of a QLoRA step's peak at the 1B-like shape)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_training_step_imports_neither_torchmetrics_nor_transformers():
    code = textwrap.dedent("""
        import sys
        import torch
        from smalti.llm import LLM
        from smalti.llm.hf import import_hf  # noqa: F401  (the importer too)

        model = LLM(d_model=32, n_heads=4, n_layers=2, vocab_size=64, ffn_type="glu", max_seq_len=16,
                    fused_loss=True, lora={"r": 2, "targets": "all_linear"})
        batch = {"input_ids": torch.randint(0, 64, (2, 16))}
        model.loss(model(batch), batch).backward()
        print(sorted(m for m in ("torchmetrics", "transformers") if m in sys.modules))
        metrics = model.metrics()  # evaluation still gets its torchmetrics metrics
        print(sorted(metrics))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2] == "[]", lines
    assert lines[-1] == "['LanguageCrossEntropy', 'LanguagePerplexity', 'TokenAccuracy']", lines
