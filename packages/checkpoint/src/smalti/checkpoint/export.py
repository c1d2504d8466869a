"""Read a sharded checkpoint back whole in one process: for export to safetensors and for ``inspect``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from smalti.storage import atomic_write


def load_full(folder: Path, prefix: str = "model.", trust_pickles: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of the DCP checkpoint in ``folder``, consolidated (no process group needed).
    Nothing read runs code unless ``trust_pickles`` (see :mod:`smalti.checkpoint.safe_load`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from smalti.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, unwrap_unsafe

    metadata = SafeFileSystemReader(folder, trust_pickles).read_metadata()
    wanted: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            wanted[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        try:
            dcp.load(wanted, storage_reader=SafeFileSystemReader(folder, trust_pickles),
                     planner=SafeLoadPlanner(trust_pickles=trust_pickles), no_dist=True)
        except BaseException as exc:
            unsafe = unwrap_unsafe(exc)
            if unsafe is None:
                raise
            raise unsafe from None
    return {key[len(prefix) :]: value for key, value in wanted.items()}


def export_safetensors(
    folder: Path, out: Path, dtype: str | None = None, trust_pickles: bool = False
) -> dict[str, torch.Tensor]:
    """Write the checkpoint's model weights to one safetensors file (through a temp name); return them."""
    from safetensors.torch import save_file

    tensors = load_full(folder, trust_pickles=trust_pickles)
    if dtype:
        target = getattr(torch, dtype)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # safetensors writes by file name: the temp file is saved over, then committed by atomic_write
    with atomic_write(out, "wb") as f:
        save_file(tensors, f.name, metadata={"format": "pt", "source": str(folder)})
    return tensors


def describe(folder: Path, trust_pickles: bool = False) -> list[tuple[str, str, str]]:
    """``(key, dtype, shape)`` of every entry DCP stored (tensors and objects), sorted by key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from smalti.checkpoint.safe_load import read_dcp_metadata

    rows = []
    for key, meta in read_dcp_metadata(folder / ".metadata", trust_pickles).state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            rows.append((key, str(meta.properties.dtype).removeprefix("torch."), "x".join(map(str, meta.size)) or "scalar"))
        else:
            rows.append((key, "object", "-"))
    return sorted(rows)
