"""Models that draw random numbers (dropout, MoE router jitter) resume bit-identically after a SIGKILL.

A run is killed (SIGKILL, no clean-up) after a committed checkpoint, started again with
``checkpoint.autoresume=true``, and must end with parameters and optimizer state equal (``torch.equal``) to an
uninterrupted run's. This holds only if nothing but the model draws from torch's global generator between the
restore of the RNG states and the next step: ``iter(DataLoader)`` used to (its workers' base seed), which
shifted every dropout mask and jitter draw after a resume.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from smalti.checkpoint.export import load_full  # noqa: E402
from smalti.testing.torchrun import run_process_group  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBES = ROOT / "packages" / "core" / "tests" / "launch_fixtures"  # launch_probe.KillOnce


def train(workdir: Path, name: str, overrides: list[str], *extra: str, timeout: float = 120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMALTI_RUN_NAME": name,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBES), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "smalti.core.cli.train", *overrides, "callbacks=[]", "logger=[]", "checkpoint=dcp",
           f"hydra.run.dir={workdir / name}", *extra]
    return run_process_group(cmd, env=env, cwd=workdir, timeout=timeout)


def final_state(folder: Path) -> dict[str, torch.Tensor]:
    return {**load_full(folder, "model."), **{f"optim.{k}": v for k, v in load_full(folder, "optim.").items()}}


def kill_and_resume(tmp_path: Path, overrides: list[str], save_every: int, kill_at: int, last: str,
                    timeout: float = 120) -> None:
    """Reference run and, at the same time, a run killed at the end of batch ``kill_at``; then the resumed run;
    compare the ``last`` checkpoints. (The two first runs share nothing but the config: on 2 cores, each of these
    one-thread processes gets a core of its own.)"""
    ck, marker = tmp_path / "ck", tmp_path / "killed.txt"
    common = [f"checkpoint.save_folder={ck}", f"checkpoint.save_interval={save_every}ba", "checkpoint.autoresume=true"]
    with ThreadPoolExecutor(2) as pool:
        reference_run = pool.submit(train, tmp_path, "reference", overrides, f"checkpoint.save_folder={tmp_path / 'ref'}",
                                    "checkpoint.save_interval=null", timeout=timeout)
        killed_run = pool.submit(train, tmp_path, "run", overrides, *common,
                                 "+callbacks.kill._target_=launch_probe.KillOnce", f"+callbacks.kill.marker={marker}",
                                 f"+callbacks.kill.batch={kill_at}", "+callbacks.kill.rank=0", timeout=timeout)
        ref, killed = reference_run.result(), killed_run.result()
    assert ref.returncode == 0, ref.stderr[-4000:]
    assert killed.returncode == -9, killed.stderr[-4000:]
    assert marker.exists() and not (ck / last).exists()
    resumed = train(tmp_path, "run", overrides, *common, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    resumed_at = kill_at // save_every * save_every
    assert f"batch {resumed_at}" in resumed.stdout + resumed.stderr

    reference, got = final_state(tmp_path / "ref" / last), final_state(ck / last)
    assert set(reference) == set(got)
    differ = [key for key in reference if not torch.equal(reference[key], got[key])]
    assert not differ, f"{len(differ)} of {len(reference)} tensors differ after the resume: {differ[:5]}"


def test_mlp_with_dropout_resumes_bit_identical_across_an_epoch_boundary(tmp_path):
    # 8 batches an epoch: checkpoints at 5 and 10, killed after 11, resumed mid-epoch 1 (batch 2 of it).
    overrides = ["model=mlp", "model.dropout=0.3", "data=synthetic", "data.train.num_samples=256", "data.eval=null",
                 "trainer.max_duration=14ba", "trainer.eval_interval=null"]
    kill_and_resume(tmp_path, overrides, save_every=5, kill_at=11, last="ep1-ba14")


@pytest.mark.timeout(900)
def test_optimizer_in_backward_resumes_bit_identical(tmp_path):
    """The optimizer stepped per parameter inside backward (trainer.optimizer_in_backward): its DCP checkpoint
    holds the configured optimizer's usual state, and a killed run resumes to the uninterrupted run's weights
    and AdamW moments."""
    overrides = ["model=mlp", "model.dropout=0.3", "data=synthetic", "data.train.num_samples=256", "data.eval=null",
                 "trainer.max_duration=6ba", "trainer.eval_interval=null", "trainer.optimizer_in_backward=true"]
    kill_and_resume(tmp_path, overrides, save_every=2, kill_at=3, last="ep0-ba6", timeout=240)


def test_moe_tiny_with_router_jitter_resumes_bit_identical(tmp_path):
    overrides = ["experiment=moe_tiny", "+model.moe.router_jitter=0.1", "model.n_layers=1", "model.max_seq_len=32",
                 "data.global_train_batch_size=8", "data.eval=null",
                 "trainer.max_duration=6ba", "trainer.eval_interval=null"]
    kill_and_resume(tmp_path, overrides, save_every=2, kill_at=3, last="ep0-ba6")


@pytest.mark.timeout(1500)
def test_lora_finetune_resumes_bit_identical_from_adapter_only_checkpoints(tmp_path):
    """LoRA (adapter dropout draws from the generator): the checkpoint holds the adapters, their optimizer state
    and the base's content hash only, and a killed run resumes bit-identically; another base is refused."""
    from smalti.testing.hf_models import write_tiny_hf_model

    source = write_tiny_hf_model(tmp_path / "base", "qwen2")
    overrides = ["experiment=finetune_hf_lora", f"model.pretrained={source}", "model.max_seq_len=64",
                 "data.global_train_batch_size=4", "model.lora.r=4", "optimizer.lr=1e-2", "trainer.max_duration=6ba",
                 "trainer.eval_interval=null"]
    kill_and_resume(tmp_path, overrides, save_every=2, kill_at=3, last="ep0-ba6", timeout=400)
    saved = load_full(tmp_path / "ck" / "ep0-ba6", "model.")
    assert saved and all(".lora_A." in k or ".lora_B." in k or k == "lora_base.sha256" for k in saved), sorted(saved)
    assert saved["lora_base.sha256"].any()
    other = write_tiny_hf_model(tmp_path / "other", "qwen2", seed=1)
    refused = train(tmp_path, "run", [*overrides, f"model.pretrained={other}", "trainer.max_duration=8ba"],
                    f"checkpoint.save_folder={tmp_path / 'ck'}", "checkpoint.autoresume=true", timeout=400)
    assert refused.returncode != 0
    assert "trained on a base with sha256" in refused.stdout + refused.stderr
