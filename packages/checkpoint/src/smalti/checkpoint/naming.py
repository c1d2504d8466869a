"""Checkpoint folder names: ``ep{epoch}-ba{batch}``, sortable by training time."""

from __future__ import annotations

import re

_NAME_RE = re.compile(r"^ep(\d+)-ba(\d+)$")

#: The file whose presence (and validity) makes a folder a checkpoint. Written last.
MANIFEST_NAME = "manifest.json"
#: A small text file in the save folder naming the newest committed checkpoint.
LATEST_NAME = "latest"


def folder_name(epoch: int, batch: int) -> str:
    """The folder name of a checkpoint taken at ``epoch``/``batch`` (total batches), e.g. ``ep1-ba2000``."""
    return f"ep{epoch}-ba{batch}"


def parse_folder_name(name: str) -> tuple[int, int] | None:
    """``(epoch, batch)`` of a checkpoint folder name, or ``None`` when ``name`` is not one."""
    match = _NAME_RE.match(name.rstrip("/"))
    if not match:
        return None
    return int(match.group(1)), int(match.group(2))


def sort_key(name: str) -> tuple[int, int]:
    """Order checkpoint names by total batches, then epoch (newest last)."""
    parsed = parse_folder_name(name)
    if parsed is None:
        return (-1, -1)
    epoch, batch = parsed
    return (batch, epoch)


def checkpoint_names(names: list[str]) -> list[str]:
    """The checkpoint folder names among ``names``, oldest first."""
    return sorted((n for n in names if parse_folder_name(n) is not None), key=sort_key)
