"""End to end: ``smalti-train experiment=gpt_tiny`` from the repository root trains, evaluates and runs ICL."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_smalti_train_gpt_tiny_loss_falls(tmp_path):
    pytest.importorskip("smalti.llm")
    env = {**os.environ, "SMALTI_RUN_NAME": "llm-e2e", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "smalti.core.cli.train", "experiment=gpt_tiny", "trainer.max_duration=40ba",
           "trainer.eval_interval=20ba", "callbacks=[]", "logger=[]", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    final = float(re.search(r"with loss ([0-9.]+)", out).group(1))
    assert final < math.log(2048) - 3.0, out[-2000:]  # from ~7.6 nats (uniform) to well below
    assert re.search(r"icl/mc_phrases/0shot/accuracy=([0-9.]+)", out), out[-2000:]
