"""Running ``smalti-train`` in a subprocess the way a user would, for tests of what a run leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: variables that name a run: cleared unless the test sets them, so a run's name is the test's choice
RUN_NAME_VARS = ("SMALTI_RUN_NAME", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SMALTI_SWEEP_RUN_NAME")


def smalti_train(args: Sequence[str], cwd: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                 timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m smalti.core.cli.train *args`` in ``cwd`` with one thread, output captured, bounded by
    ``timeout`` seconds; run-naming variables come only from ``env``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for var in RUN_NAME_VARS:
        if var not in (env or {}):
            full_env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "smalti.core.cli.train", *args], cwd=Path(cwd), env=full_env,
                          capture_output=True, text=True, timeout=timeout)
