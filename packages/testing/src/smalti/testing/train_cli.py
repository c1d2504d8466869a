"""Running ``smalti-train`` the way a user would, for tests of what a run leaves behind: in a subprocess, or in
this process where a refusal at start is what the test is about (no interpreter start, no imports again)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

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


def smalti_train_in_process(args: Sequence[str], cwd: str | os.PathLike[str],
                            monkeypatch: pytest.MonkeyPatch) -> tuple[int | str | None, str]:
    """``smalti-train *args`` in this process (Hydra's own app runner, as the console script calls it) in ``cwd``:
    its exit code and what it wrote to stderr. Run-naming variables are cleared, Hydra's global state is reset
    before and after, and ``monkeypatch`` undoes the directory and ``sys.argv`` changes at the test's end."""
    import pytest
    from hydra.core.global_hydra import GlobalHydra

    from smalti.core.cli import train

    for var in RUN_NAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["smalti-train", *args])
    err = io.StringIO()
    GlobalHydra.instance().clear()
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
            train.main()
    finally:
        GlobalHydra.instance().clear()
    return info.value.code, err.getvalue()
