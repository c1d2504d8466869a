"""``smalti-llm hf export --checkpoint``: a committed smalti-checkpoint of an ``experiment=finetune_hf`` run becomes
the same Hugging Face folder the run's ``hf_export`` callback wrote at fit end (here sharded into several files),
and ``transformers`` loads it; a folder without a manifest or without a known source model is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from smalti.testing.hostile_checkpoints import craft_metadata, reseal

ROOT = Path(__file__).resolve().parent.parent


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_hf_export_from_checkpoint_equals_the_fit_end_export(tmp_path, capsys):
    import transformers

    from smalti.llm.cli import main
    from smalti.testing.hf_models import write_tiny_hf_model

    source = write_tiny_hf_model(tmp_path / "src", "qwen2")
    run = tmp_path / "run"
    env = {**os.environ, "SMALTI_RUN_NAME": "hf-ckpt", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "smalti.core.cli.train", "experiment=finetune_hf", f"model.pretrained={source}",
           "callbacks=[hf_export]", "logger=[]", f"hydra.run.dir={run}",
           "trainer.max_duration=3ba", "trainer.eval_interval=null", "model.max_seq_len=64",
           "data.global_train_batch_size=4", "optimizer.lr=1e-3", "checkpoint=dcp",
           f"checkpoint.save_folder={run / 'checkpoints'}", "checkpoint.save_interval=null"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    out = tmp_path / "from-checkpoint"
    # no --pretrained: the source folder is read from the run's .hydra/config.yaml
    assert main(["hf", "export", "--checkpoint", str(run / "checkpoints"), "--out", str(out),
                 "--max-shard-size", "60KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    at_fit_end, exported = _tensors(run / "hf"), _tensors(out)
    assert sorted(exported) == sorted(at_fit_end)
    for name, value in at_fit_end.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
    assert json.loads((out / "config.json").read_text()) == json.loads((run / "hf" / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(run / "hf"), local_files_only=True).eval()
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits)

    # A checkpoint copied away from its run has no run config: the source folder must be named.
    (ckpt,) = [p for p in (run / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("ep")]
    lone = tmp_path / "elsewhere" / ckpt.name
    shutil.copytree(ckpt, lone)
    capsys.readouterr()
    assert main(["hf", "export", "--checkpoint", str(lone), "--out", str(tmp_path / "x")]) == 2
    assert "--pretrained is needed" in capsys.readouterr().err
    assert main(["hf", "export", "--checkpoint", str(lone), "--pretrained", str(source), "--out",
                 str(tmp_path / "y")]) == 0

    # A crafted .metadata (its manifest resealed to match) runs no code: the export refuses it.
    crafted = tmp_path / "crafted" / ckpt.name
    shutil.copytree(ckpt, crafted)
    marker = tmp_path / "ran"
    craft_metadata(crafted, marker)
    reseal(crafted)
    capsys.readouterr()
    assert main(["hf", "export", "--checkpoint", str(crafted), "--pretrained", str(source), "--out",
                 str(tmp_path / "w")]) != 0
    assert not marker.exists()
    assert "builtins.eval" in capsys.readouterr().err

    (lone / "manifest.json").unlink()  # not committed: never exported
    assert main(["hf", "export", "--checkpoint", str(lone), "--pretrained", str(source), "--out",
                 str(tmp_path / "z")]) == 2
    assert not (tmp_path / "z").exists()


def test_an_mpt_recipe_checkpoint_exports_as_gpt2_that_transformers_loads(tmp_path, capsys):
    """A model trained from scratch in the mpt_* recipes' shape (learned positions, LayerNorm, GELU MLP, no biases)
    has no Hugging Face source: its checkpoint becomes transformers' own GPT-2, with the run's tokenizer."""
    import transformers

    from smalti.llm.cli import main
    from smalti.llm.hf.exporter import checkpoint_tensors
    from smalti.llm.model.copies import build_with_weights

    run = tmp_path / "run"
    env = {**os.environ, "SMALTI_RUN_NAME": "mpt-ckpt", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "smalti.core.cli.train", "experiment=gpt_tiny", "model.position=learned",
           "model.norm_type=low_precision_layernorm", "+model.activation=gelu", "model.n_layers=2",
           "callbacks=[]", "logger=[]", f"hydra.run.dir={run}", "trainer.max_duration=2ba",
           "trainer.eval_interval=null", "data.global_train_batch_size=4", "checkpoint=dcp",
           f"checkpoint.save_folder={run / 'checkpoints'}", "checkpoint.save_interval=null"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    out = tmp_path / "hf"
    assert main(["hf", "export", "--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tok("the checkpoint and the export agree")["input_ids"]])

    (ckpt,) = [p for p in (run / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("ep")]
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "config.yaml").model)
    kwargs = {k: v for k, v in node.items() if not k.startswith("_") and k != "init_device"}
    from smalti.llm import LLM

    names = [k for k in LLM(**kwargs, init_device="meta").state_dict() if not k.endswith("_extra_state")]
    trained = build_with_weights(LLM(**kwargs, init_device="meta").config, dict(checkpoint_tensors(ckpt, names)[1]))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trained({"input_ids": ids})["logits"], rtol=1e-5, atol=2e-5)
