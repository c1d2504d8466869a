"""``experiment=finetune_hf`` end to end on tiny random Llama 3, Mistral and Qwen2 models written by
``transformers``: 20 steps on the shipped chat data lower the loss on assistant tokens, the run leaves
``outputs/<run>/hf`` that ``transformers`` loads (model and tokenizer) with the trained model's logits, and the
same run on two gloo ranks with ``parallelism=fsdp_sp parallelism.sp=2`` gives the single process's losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402

STEPS = 20
COMMON = [f"trainer.max_duration={STEPS}ba", "trainer.eval_interval=null", "optimizer.lr=2e-3",
          "model.max_seq_len=64", "data.global_train_batch_size=4"]


def _losses(metrics_file: Path) -> list[float]:
    from smalti.core.loggers import read_jsonl

    by_step: dict[int, float] = {}
    for record in read_jsonl(metrics_file):
        if "loss/train/total" in record.get("metrics", {}):
            by_step[record["step"]] = record["metrics"]["loss/train/total"]
    return [by_step[s] for s in sorted(by_step)]


def _assert_falls(losses: list[float]) -> None:
    assert len(losses) == STEPS, losses
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.5, losses


def _train_cli(run_dir: Path, name: str, overrides: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "SMALTI_RUN_NAME": name, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = ["experiment=finetune_hf", "callbacks=[hf_export]", "logger=[jsonl]", f"hydra.run.dir={run_dir}", *COMMON,
            *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "smalti.core.cli.train", *args]
    else:
        from smalti.testing.torchrun import torchrun_command

        cmd = [*torchrun_command(nproc), "-m", "smalti.core.cli.train", *args]
    from smalti.testing.torchrun import run_process_group

    proc = run_process_group(cmd, env=env, timeout=300, cwd=run_dir.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _check_export(folder: Path, source: Path, model: torch.nn.Module | None = None) -> None:
    """``transformers`` loads ``folder`` (same family as ``source``) and its logits equal ``model``'s (default:
    smalti's import of the folder)."""
    from smalti.llm.hf import import_hf

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == json.loads((source / "config.json").read_text())["model_type"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = torch.tensor([tok("The weaver sold seven copper coins at the harbour.")["input_ids"] * 2])
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(source), local_files_only=True).eval()
    model = (model or import_hf(folder)).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(theirs, model({"input_ids": ids})["logits"], atol=1e-4, rtol=1e-4)
        assert (theirs - ref(ids).logits).abs().max() > 1e-2  # the export holds the trained weights


def test_smalti_train_finetune_hf_llama3_learns_and_exports(tmp_path):
    source = write_tiny_hf_model(tmp_path / "llama3", "llama3")
    run_dir = tmp_path / "run"
    _train_cli(run_dir, "finetune-hf-llama3", [f"model.pretrained={source}"])
    _assert_falls(_losses(run_dir / "metrics.jsonl"))
    _check_export(run_dir / "hf", source)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_finetune_hf_in_process_exports_the_trained_model(tmp_path, monkeypatch, family):
    """The run's own model (not a re-import) gives the exported folder's logits in ``transformers``."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.config.build import build_trainer
    from smalti.core.config.schema import register_configs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # without a Hydra run folder the export goes to ./outputs/<run>/hf
    source = write_tiny_hf_model(tmp_path / family, family)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=finetune_hf", f"model.pretrained={source}", "callbacks=[hf_export]",
                                          "logger=[jsonl]", f"logger.jsonl.path={tmp_path / 'm.jsonl'}",
                                          f"run_name=ft-{family}", *COMMON])
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        _assert_falls(_losses(tmp_path / "m.jsonl"))
        _check_export(tmp_path / "outputs" / f"ft-{family}" / "hf", source, trainer.state.raw_model)
    finally:
        trainer.close()


def test_finetune_hf_sequence_parallel_two_ranks_matches_one_process(tmp_path):
    source = write_tiny_hf_model(tmp_path / "mistral", "mistral", sliding_window=24)
    # fp32: sequence parallelism is exact there; under bf16 autocast the split sequence rounds differently.
    overrides = [f"model.pretrained={source}", "precision=fp32"]
    _train_cli(tmp_path / "one", "ft-one", overrides)
    _train_cli(tmp_path / "sp", "ft-sp", [*overrides, "parallelism=fsdp_sp", "parallelism.sp=2"], nproc=2)
    single, parallel = _losses(tmp_path / "one" / "metrics.jsonl"), _losses(tmp_path / "sp" / "metrics.jsonl")
    assert len(single) == STEPS
    assert parallel == pytest.approx(single, rel=1e-4)
    # The export gathered from the two ranks' FSDP shards is the single process's model (measured: 8.5e-7 apart;
    # training moved the logits by 2.0 from the source's).
    one, sp = (transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / d / "hf"), local_files_only=True).eval()
               for d in ("one", "sp"))
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(sp(ids).logits, one(ids).logits, atol=1e-4, rtol=1e-4)


def test_chat_rows_too_few_for_the_batch_fail_in_one_line_with_the_numbers(tmp_path):
    """64 short chats packed at 2,048 tokens make 3 rows: one line says so, with the batch and what to change."""
    source = write_tiny_hf_model(tmp_path / "qwen2", "qwen2")
    chats = [{"messages": [{"role": "user", "content": f"What is {n} plus one?"},
                           {"role": "assistant", "content": f"It is {n + 1}."}]} for n in range(64)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "smalti.core.cli.train", "experiment=finetune_hf",
                           f"model.pretrained={source}", "data.train.path=chat.jsonl", "model.max_seq_len=2048",
                           "hydra.run.dir=run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("smalti-train:")]
    rows = int(line.split("data.train has no full batch: ")[1].split()[0])
    assert rows < 16
    for part in (f"64 examples read from chat.jsonl, packed into {rows} rows of max_seq_len=2048 tokens",
                 "data.global_train_batch_size=16 over 1 data-parallel rank(s)", f"at most {rows}",
                 "smaller max_seq_len"):
        assert part in line, line
