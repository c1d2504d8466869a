"""Thin helpers over ``torch.distributed``: start the process group from torchrun's environment, agree across ranks."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from smalti.core.errors import DistributedError

log = logging.getLogger(__name__)

#: torchrun's agent reads it: "1" gives restarted workers a fresh rendezvous store each round. Left unset, the
#: workers share the agent's TCP store, whose keys outlive a failed round; after a worker dies the restarted
#: group fails to reconnect (gloo: connection refused) or hangs (pytorch/pytorch#135712).
RDZV_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_restart_warning_given = False


def restart_store_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """What to tell a torchrun worker whose restarts may not restart, or None when all is well.

    Restarts are on when torchrun exported ``TORCHELASTIC_MAX_RESTARTS`` above 0; they work when the agent ran
    with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (workers inherit its environment, so they see the same value).
    """
    try:
        max_restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if max_restarts <= 0 or environ.get(RDZV_STORE_ENV) == "1":
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":  # a rendezvous that shares no store
        return None
    return (
        f"torchrun restarts are on (--max-restarts={max_restarts}) but {RDZV_STORE_ENV} is not set to 1: after a "
        "worker dies, the restarted workers can fail to reconnect (gloo: connection refused) or hang, because they "
        f"share the agent's rendezvous store. Start torchrun with it set, e.g. `{RDZV_STORE_ENV}=1 torchrun "
        f"--standalone ...`, or `export {RDZV_STORE_ENV}=1` before torchrun on every node (smalti-launch k8s and "
        "the Slurm/submitit launchers set it themselves)"
    )


def warn_if_restarts_may_hang(environ: Mapping[str, str] = os.environ) -> bool:
    """Log :func:`restart_store_problem`'s warning once, on rank 0 of the first attempt; return whether it did."""
    global _restart_warning_given
    if _restart_warning_given or environ.get("RANK", "0") != "0" or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    problem = restart_store_problem(environ)
    if problem is None:
        return False
    _restart_warning_given = True
    log.warning(problem)
    return True


def env_world_size() -> int:
    """World size from the launcher's environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """This rank's CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(backend: str | None = None, timeout_s: float = 600) -> bool:
    """Start the default process group from torchrun's variables when ``WORLD_SIZE > 1``.

    Returns whether a group is running. NCCL on CUDA, gloo on CPU unless ``backend`` says otherwise.
    """
    if is_initialized():
        return True
    if env_world_size() <= 1:
        return False
    warn_if_restarts_may_hang()  # smalti-train warns earlier; this covers a Trainer started from Python
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank() % torch.cuda.device_count())
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # pragma: no cover - depends on the launcher
        raise DistributedError(
            f"could not start the {backend} process group (RANK={os.environ.get('RANK')}, "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}, MASTER_ADDR={os.environ.get('MASTER_ADDR')}): {exc}"
        ) from exc
    return True


def all_reduce_max(value: int, device: torch.device, group: Any = None) -> int:
    """The largest ``value`` over the ranks of ``group`` (default: all; ``value`` itself without a process group)."""
    if not is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def all_reduce_mean_(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over ranks in place."""
    if is_initialized() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= get_world_size()
    return tensor


def config_digest(config: dict[str, Any]) -> dict[str, str]:
    """A short hash of each top-level key's resolved value, for comparing configs across ranks."""
    return {
        key: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
        for key, value in config.items()
    }


def check_same_config(config: dict[str, Any]) -> None:
    """Fail on every rank, naming the keys, when the ranks composed different configs."""
    if not is_initialized() or get_world_size() == 1:
        return
    mine = config_digest(_flatten(config))
    gathered: list[dict[str, str] | None] = [None] * get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = sorted({k for other in gathered for k in set(other or {}) | set(mine) if (other or {}).get(k) != mine.get(k)})
    if differing:
        raise DistributedError(
            f"ranks composed different configs; keys that differ: {', '.join(differing)}. "
            "Every rank must get the same command line and config files (no ${now:} or per-rank values)."
        )


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def shutdown() -> None:
    """Wait for every rank, then destroy the process group (gloo aborts at exit if it is left running)."""
    if is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
