"""Run a script or a pytest node under ``torchrun`` with a loopback rendezvous and a time-out."""

from __future__ import annotations

import contextlib
import os
import signal
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
    return run_process_group(cmd, env=full_env, timeout=timeout, cwd=cwd)


def run_process_group(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session, capturing output; on time-out kill the whole process group and raise.

    torchrun's workers are the launcher's children in sessions of their own: killing only the launcher's group
    would leave them running, so they are found and killed too.
    """
    proc = subprocess.Popen(
        list(cmd), env=dict(env) if env is not None else None, cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate(timeout=30)
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=out, stderr=err) from None
    except BaseException:  # the test itself was stopped (pytest-timeout, Ctrl-C): leave nothing running
        kill_tree(proc.pid)
        proc.wait(timeout=30)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL process group ``pid`` and every process below ``pid`` (torchrun starts each worker in a session of
    its own, out of reach of the group)."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from ``/proc``; empty where there is none."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group ``pgid``, read from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found
