"""Checkpoints as an attacker hands them over: a pickle that runs code, and a manifest rewritten to match.

For the tests of smalti-checkpoint and of the packages that read its checkpoints (``smalti-llm hf export``).
:func:`reseal` and :func:`craft_metadata` need smalti-checkpoint installed (the ``checkpoint`` extra).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any


class RunsCode:
    """Unpickles by evaluating Python: creates the file ``marker``, then stands for ``value``."""

    def __init__(self, marker: str | Path, value: Any = None) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').close() or {self.value!r}",)


def reseal(folder: Path, legacy: bool = False) -> None:
    """Rewrite ``folder``'s manifest to match its files as they are now, as anyone handing over a checkpoint can.

    ``legacy`` writes the unsealed ``smalti-checkpoint/1`` format that older checkpoints have.
    """
    from smalti.checkpoint.manifest import hash_file, seal

    manifest = json.loads((folder / "manifest.json").read_text())
    for rel in manifest["files"]:
        size, sha = hash_file(folder / rel)
        manifest["files"][rel] = {"size": size, "sha256": sha}
    manifest.pop("manifest_sha256", None)
    if legacy:
        manifest["format"] = "smalti-checkpoint/1"
    else:
        manifest = seal(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def craft_metadata(folder: Path, marker: Path) -> str:
    """Put a code-running object into ``folder``'s DCP ``.metadata`` (the manifest is left stale); its name."""
    from smalti.checkpoint.safe_load import read_dcp_metadata

    metadata = read_dcp_metadata(folder / ".metadata")
    metadata.storage_meta.modules = [RunsCode(marker)]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return ".metadata"
