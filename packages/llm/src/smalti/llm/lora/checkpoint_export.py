"""``smalti-llm hf export --checkpoint`` for a LoRA run: its checkpoint holds only the adapters (and the base's
content hash), so the base is read again from ``model.pretrained``, checked against the hash, given the
checkpoint's adapters, and written as a PEFT adapter folder and (``merge``) a merged Hugging Face folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import LoRAError
from smalti.llm.lora.export import export_lora
from smalti.llm.lora.naming import clean_name

HASH_KEY = "lora_base.sha256"


def is_lora_checkpoint(metadata_keys: Any) -> bool:
    """Whether a checkpoint's state keys (``model.<name>``) hold LoRA adapters."""
    return any(".lora_A." in key for key in metadata_keys)


def export_lora_checkpoint(folder: Path, lora: dict[str, Any], source: Path, out: str | os.PathLike,
                           merge: bool = True, dtype: str | None = None,
                           max_shard_size: int | str = "2GB") -> tuple[Path, Path | None]:
    """Write the adapters of the committed LoRA checkpoint ``folder`` to ``out/adapter`` (PEFT's format) and,
    with ``merge``, the base ``source`` with them merged to ``out/hf``, as the run's ``hf_export`` does.

    ``lora``: the run's ``model.lora`` settings. The checkpoint's base hash must be ``source``'s.
    """
    from smalti.llm.hf.exporter import checkpoint_tensors
    from smalti.llm.hf.importer import import_hf

    settings = {k: v for k, v in lora.items() if k != "init_from"}  # the checkpoint's adapters replace its start
    model = import_hf(source, lora=settings)
    params = {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    _, tensors = checkpoint_tensors(folder, [HASH_KEY, *params])
    with torch.no_grad():
        for name, value in tensors:
            if name == HASH_KEY:
                theirs, ours = bytes(value.to(torch.uint8).tolist()), model.lora_base.expected
                if theirs != ours:
                    raise LoRAError(
                        f"{folder}: the adapters were trained on a base with sha256 {theirs.hex()[:16]}…, but "
                        f"{source} has sha256 {ours.hex()[:16]}…: give the run's base folder as --pretrained")
                continue
            if tuple(value.shape) != tuple(params[name].shape):
                raise LoRAError(f"{folder}: model.{name} has shape {tuple(value.shape)}, the run's model.lora "
                                f"gives {tuple(params[name].shape)}")
            params[name].copy_(value)
    base = Path(out)
    return export_lora(model.eval(), base / "adapter", base / "hf" if merge else None, dtype=dtype,
                       max_shard_size=max_shard_size)
