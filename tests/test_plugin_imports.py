"""Plugin discovery stays cheap: loading every installed ``smalti`` entry point imports no torch or NumPy.

Every smalti-train start and every test subprocess loads all entry points (``discover_entry_points``); an
entry-point module that imports its package's heavy names (``Checkpointer`` brings torch's FSDP and DCP
modules) costs seconds in each of them. Each check runs in a fresh interpreter, since this one has torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules no entry point may import: torch itself, what ``Checkpointer`` pulls in, and what the streaming
#: dataset needs (NumPy, the codecs, the object-store layer).
HEAVY = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "numpy", "zstandard", "smalti.storage"]

DISCOVER = r"""
import json, sys
import importlib.metadata as md
heavy = json.loads(sys.argv[1])
pulled = {}
for ep in sorted(md.entry_points(group="smalti"), key=lambda e: e.name):
    before = {m for m in heavy if m in sys.modules}
    ep.load()
    new = sorted(m for m in heavy if m in sys.modules and m not in before)
    if new:
        pulled[f"{ep.name} ({ep.value})"] = new
from smalti.core.plugins.manager import discover_entry_points
names = [name for name, _, _ in discover_entry_points()]
print(json.dumps({"names": names, "pulled": pulled, "heavy": [m for m in heavy if m in sys.modules]}))
"""


def run_python(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_loading_every_entry_point_imports_no_torch():
    result = json.loads(run_python(DISCOVER, json.dumps(HEAVY)))
    # The plugins this check is about are installed (tests/ runs with every package).
    assert {"checkpoint", "core", "health", "llm", "moe", "streaming"} <= set(result["names"]), result["names"]
    assert result["pulled"] == {}, f"entry points that import heavy modules: {result['pulled']}"
    assert result["heavy"] == []


def test_checkpoint_names_import_on_first_use():
    """``from smalti.checkpoint import ...`` and ``import *`` give the same names as before the lazy imports.

    In this process (torch is cheap once imported): that importing the package alone imports no DCP is the
    check above, in a fresh interpreter.
    """
    import smalti.checkpoint as ck
    from smalti.checkpoint import CheckpointCorruptError, Checkpointer, CheckpointError
    from smalti.checkpoint.checkpointer import Checkpointer as Direct

    assert ck.__all__ == [
        "CheckpointCorruptError", "CheckpointError", "CheckpointUploadError", "Checkpointer", "ReshardError",
        "UnsafeCheckpointError", "UnsafePathError",
    ]
    assert set(ck.__all__) <= set(dir(ck))
    assert Checkpointer is Direct and issubclass(CheckpointCorruptError, CheckpointError)
    namespace: dict = {}
    exec("from smalti.checkpoint import *", namespace)
    assert sorted(n for n in namespace if not n.startswith("__")) == ck.__all__
    assert all(namespace[n] is getattr(ck, n) for n in ck.__all__)
    with pytest.raises(AttributeError, match="NoSuchName"):
        ck.NoSuchName  # noqa: B018
