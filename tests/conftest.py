"""Fixtures shared by the cross-package tests.

``restart_reference``: the uninterrupted 2-rank run that the restart tests (``test_restarts``,
``test_health_restart``, ``test_scale_out``) interrupt in their own ways (a SIGKILLed rank under torchrun or a
submitit job, a hung rank ended by the watchdog, a lost rank of a two-node job). Each of those used to run the
same reference itself; it is run once per session here, and each test builds its faulty run from
``restart_reference.overrides`` so that the two cannot drift apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: test-only callbacks the training workers import through PYTHONPATH: launch_probe (ParamDigest, KillOnce) and
#: health_probe (HangOnce)
PROBES = (ROOT / "packages" / "core" / "tests" / "launch_fixtures", ROOT / "tests" / "fixtures")

#: 2 ranks of FSDP over a model with dropout (so the RNG states must be restored too), a checkpoint every 2 of the
#: 6 batches with autoresume, and rank 0 writing every parameter's value at fit end (``digest.json`` in the cwd)
RESTART_RUN = (
    "model=mlp", "model.dropout=0.2", "data=synthetic", "data.eval=null", "parallelism=fsdp", "callbacks=[]",
    "logger=[jsonl]", "trainer.max_duration=6ba", "trainer.eval_interval=null", "checkpoint=dcp",
    "checkpoint.save_interval=2ba", "checkpoint.autoresume=true",
    "+callbacks.digest._target_=launch_probe.ParamDigest", "+callbacks.digest.path=digest.json",
)


def probe_env(**extra: str) -> dict[str, str]:
    """The environment of a training process that may use the probe callbacks: one thread, probes importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, PROBES), os.environ.get("PYTHONPATH")])), **extra}


@dataclass(frozen=True)
class ReferenceRun:
    """An uninterrupted run of ``overrides`` (plus ``checkpoint.save_folder``) on 2 ranks."""

    overrides: tuple[str, ...]
    #: its last checkpoint (``ep0-ba6``)
    checkpoint: Path
    #: ``ParamDigest``'s record of its final parameters
    digest: dict[str, Any]


@pytest.fixture(scope="session")
def restart_reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    """``RESTART_RUN`` on 2 ranks, never interrupted; run once for every test that asks."""
    from smalti.testing.torchrun import run_process_group, torchrun_command

    workdir = tmp_path_factory.mktemp("restart-reference")
    cmd = [*torchrun_command(2, extra=["--rdzv-id=reference"]), "-m", "smalti.core.cli.train", *RESTART_RUN,
           f"checkpoint.save_folder={workdir / 'ck'}"]
    out = run_process_group(cmd, env=probe_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", SMALTI_RUN_NAME="reference"),
                            cwd=workdir, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return ReferenceRun(overrides=RESTART_RUN, checkpoint=workdir / "ck" / "ep0-ba6",
                        digest=json.loads((workdir / "digest.json").read_text()))
