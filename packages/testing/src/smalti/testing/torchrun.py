"""Run a script or a pytest node under ``torchrun`` with a loopback rendezvous and a time-out."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from smalti.testing.ports import free_port


def torchrun_command(nproc: int, port: int | None = None, nnodes: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """The ``python -m torch.distributed.run`` prefix for ``nproc`` local workers on a c10d loopback rendezvous."""
    port = port or free_port()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--tee=3",
        *extra,
    ]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    module: bool = False,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (or ``-m module`` when ``module``) in ``nproc`` ranks; output captured, killed after ``timeout``.

    Raises ``subprocess.TimeoutExpired`` when the job hangs, so a hang fails the calling test.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    target = ["-m", str(script)] if module else [str(script)]
    cmd = torchrun_command(nproc) + target + list(args)
    return subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
