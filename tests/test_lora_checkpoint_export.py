"""``smalti-llm hf export --checkpoint`` of a LoRA run (``experiment=finetune_hf_lora``, ``checkpoint=dcp``): the
adapters-only checkpoint becomes ``out/adapter`` (PEFT loads it with the run's logits) and ``out/hf`` (the merged
model, what ``transformers`` alone loads), equal to the run's own fit-end export; another base is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_lora_checkpoint_exports_a_peft_adapter_and_a_merged_model(tmp_path, capsys, monkeypatch):
    pytest.importorskip("smalti.checkpoint")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from smalti.llm.cli import main
    from smalti.testing.hf_models import write_tiny_hf_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = write_tiny_hf_model(tmp_path / "src", "llama3")
    run = tmp_path / "run"
    env = {**os.environ, "SMALTI_RUN_NAME": "lora-ckpt", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "smalti.core.cli.train", "experiment=finetune_hf_lora", f"model.pretrained={source}",
           "callbacks=[hf_export]", "logger=[]", f"hydra.run.dir={run}", "trainer.max_duration=3ba",
           "trainer.eval_interval=null", "model.max_seq_len=64", "data.global_train_batch_size=4",
           "optimizer.lr=1e-2", "model.lora.r=4", "model.lora.base_dtype=float32", "checkpoint=dcp", f"checkpoint.save_folder={run / 'checkpoints'}",
           "checkpoint.save_interval=null"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    out = tmp_path / "export"
    assert main(["hf", "export", "--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
    fit_end, exported = _tensors(run / "adapter"), _tensors(out / "adapter")
    assert sorted(exported) == sorted(fit_end) and any(".lora_B." in k for k in exported)
    for name, value in fit_end.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
    assert any(v.abs().max() > 0 for k, v in exported.items() if ".lora_B." in k)  # trained, not fresh

    def hf(folder):
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                                 dtype=torch.float32).eval()

    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(hf(source), str(out / "adapter")).eval()(ids).logits
        merged = hf(out / "hf")(ids).logits
        torch.testing.assert_close(merged, hf(run / "hf")(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(merged, with_adapter, rtol=1e-4, atol=1e-4)  # an fp32 base: PEFT's logits
        assert (with_adapter - hf(source)(ids).logits).abs().max() > 1e-3

    assert main(["hf", "export", "--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "a"),
                 "--no-merge"]) == 0
    assert (tmp_path / "a" / "adapter" / "adapter_config.json").is_file() and not (tmp_path / "a" / "hf").exists()

    other = write_tiny_hf_model(tmp_path / "other", "llama3", seed=7)
    capsys.readouterr()
    assert main(["hf", "export", "--checkpoint", str(run / "checkpoints"), "--pretrained", str(other), "--out",
                 str(tmp_path / "b")]) == 2
    assert "give the run's base folder as --pretrained" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
