"""torchrun's command line, built in one place for every engine (local agents, Slurm nodes, Kubernetes pods).

smalti speaks torchrun's own protocol: the arguments built here are parsed by ``torch.distributed.run`` itself,
and :func:`run_torchrun` runs its elastic agent in this process exactly as the ``torchrun`` script would.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from smalti.core.errors import ConfigError

#: What every rank runs: the Hydra app, with the run's overrides appended.
TRAIN_MODULE = "smalti.core.cli.train"
#: Rendezvous ports are derived from the job id in this range when none is set, so that two jobs
#: sharing a head node (array tasks on a non-exclusive partition) do not collide.
PORT_BASE = 20000
PORT_SPAN = 20000
#: A rendezvous backend's name (c10d, static, etcd, etcd-v2): it is written into job scripts.
_BACKEND = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(kw_only=True)
class TorchrunSettings:
    """The torchrun options a launcher sets for each node (``hydra.launcher.torchrun.*`` in the Slurm/local configs).

    ``nproc_per_node`` defaults to the launcher's ``gpus_per_node`` (else 1); ``min_nodes`` below the node
    count makes the job elastic (``--nnodes=MIN:MAX``); ``rdzv_port`` defaults to one derived from the job id.
    """

    nproc_per_node: int | None = None
    rdzv_backend: str = "c10d"
    rdzv_port: int | None = None
    max_restarts: int = 0
    min_nodes: int | None = None
    monitor_interval: float | None = None
    preflight: bool = True
    extra_args: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None, where: str = "hydra.launcher.torchrun") -> TorchrunSettings:
        """Build from a config mapping; an unknown key fails naming it and the known ones."""
        values = dict(node or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(unknown)} in `{where}`; known keys: {', '.join(sorted(known))}")
        values["extra_args"] = [str(a) for a in values.get("extra_args") or []]
        for key in ("nproc_per_node", "rdzv_port", "max_restarts", "min_nodes", "monitor_interval"):
            value = values.get(key)
            kinds = (int, float) if key == "monitor_interval" else (int,)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
                raise ConfigError(f"`{where}.{key}` must be a number, got {value!r}")
        backend = values.get("rdzv_backend", "c10d")
        if not isinstance(backend, str) or not _BACKEND.match(backend):
            raise ConfigError(f"`{where}.rdzv_backend` must be a backend name such as c10d, got {backend!r}")
        settings = cls(**values)
        if settings.max_restarts < 0:
            raise ConfigError(f"`{where}.max_restarts` must be >= 0, got {settings.max_restarts}")
        if settings.nproc_per_node is not None and settings.nproc_per_node < 1:
            raise ConfigError(f"`{where}.nproc_per_node` must be >= 1, got {settings.nproc_per_node}")
        return settings

    def procs_per_node(self, gpus_per_node: int | None) -> int:
        """Ranks per node: the setting, else one per GPU, else 1."""
        return self.nproc_per_node or gpus_per_node or 1

    def args(self, *, nnodes: int | str, nproc_per_node: int, endpoint: str, rdzv_id: str) -> list[str]:
        """torchrun's options (before the program). ``nnodes``/``endpoint``/``rdzv_id`` may be shell expressions."""
        nnodes_arg = str(nnodes)
        if self.min_nodes is not None and str(self.min_nodes) != nnodes_arg:
            nnodes_arg = f"{self.min_nodes}:{nnodes}"
        out = [
            f"--nnodes={nnodes_arg}",
            f"--nproc-per-node={nproc_per_node}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--max-restarts={self.max_restarts}",
        ]
        if self.monitor_interval is not None:
            out.append(f"--monitor-interval={self.monitor_interval}")
        return out + list(self.extra_args)


def derived_port(job_id: str) -> int:
    """The rendezvous port for a job without a fixed one: numeric ids map as the Slurm shell line does."""
    digits = job_id.split("_")[0]
    number = int(digits) if digits.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def train_command(overrides: Sequence[str]) -> list[str]:
    """The program part of a torchrun command line: ``-m smalti.core.cli.train <overrides>``."""
    return ["-m", TRAIN_MODULE, *overrides]


def run_torchrun(argv: Sequence[str]) -> None:
    """Run torchrun with ``argv`` in this process (its elastic agent starts and watches the local workers).

    Raises torch's ``ChildFailedError`` when the workers fail after ``--max-restarts`` restarts.
    """
    from torch.distributed.run import parse_args, run

    run(parse_args(list(argv)))
