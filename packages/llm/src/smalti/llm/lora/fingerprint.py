"""The frozen base a LoRA model was trained on, named by content: a sha256 of the Hugging Face folder's
``config.json`` and weight files, kept as a persistent buffer so that it goes into every checkpoint (which holds
no base weights) and is checked when one is loaded: resuming adapters on another base fails, naming both."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smalti.llm.errors import LoRAError

_CHUNK = 16 * 2**20


def folder_sha256(folder: Path) -> bytes:
    """sha256 over ``config.json`` and every weight file of a Hugging Face folder (names and bytes, in name order)."""
    from smalti.llm.hf.folder import weight_files

    digest = hashlib.sha256()
    for path in sorted({folder / "config.json", *weight_files(folder).values()}):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.digest()


class BaseFingerprint(nn.Module):
    """Holds the base's sha256 (``sha256``: 32 uint8; all zero for a base that has no files, such as smalti's
    own randomly initialised model) and refuses to load a different one."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.register_buffer("sha256", torch.zeros(32, dtype=torch.uint8, device=device))
        self.source = "the model's own initialisation"
        # The hash of this run's base, outside the buffer: DCP loads a checkpoint into the buffer in place before
        # load_state_dict runs, so the check compares what arrives with this copy.
        self.expected = bytes(32)
        self.register_load_state_dict_pre_hook(self._check)

    @torch.no_grad()
    def set_from(self, folder: Path | None) -> None:
        """Record ``folder``'s content hash (``None``: no files, stays zero)."""
        self.expected = bytes(32) if folder is None else folder_sha256(Path(folder))
        if folder is not None:
            self.source = str(folder)
        self.sha256.copy_(torch.frombuffer(bytearray(self.expected), dtype=torch.uint8))

    def _check(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + "sha256")
        if saved is None:
            return
        saved = saved.full_tensor() if hasattr(saved, "full_tensor") else saved
        theirs = bytes(saved.cpu().to(torch.uint8).tolist())
        if theirs != self.expected:
            self.sha256.copy_(torch.frombuffer(bytearray(self.expected), dtype=torch.uint8))
            raise LoRAError(
                f"the checkpoint's adapters were trained on a base with sha256 {theirs.hex()[:16]}…, but this run's "
                f"base ({self.source}) has sha256 {self.expected.hex()[:16]}…: resume with the same model.pretrained "
                "folder (the checkpoint holds only the adapters)"
            )
