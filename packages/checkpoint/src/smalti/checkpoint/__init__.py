"""smalti-checkpoint: sharded, async, verifiable checkpoints through torch.distributed.checkpoint.

``Checkpointer`` is the callback ``smalti-train checkpoint=dcp`` builds. A checkpoint is a folder
``ep{epoch}-ba{batch}`` whose ``manifest.json`` (sizes and digests of every file: xxh3-128 unless
``checkpoint.hash`` says blake3 or sha256) is written last.

The names below are imported on first use: plugin discovery imports ``smalti.checkpoint.plugin`` in every
smalti process, and importing ``Checkpointer`` pulls in torch's FSDP and DCP modules (seconds of start-up).
"""

# Private aliases keep dir(smalti.checkpoint) to the public names and the submodules.
from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointCorruptError": "smalti.checkpoint.errors",
    "CheckpointError": "smalti.checkpoint.errors",
    "CheckpointUploadError": "smalti.checkpoint.errors",
    "Checkpointer": "smalti.checkpoint.checkpointer",
    "ReshardError": "smalti.checkpoint.errors",
    "UnsafeCheckpointError": "smalti.checkpoint.errors",
    "UnsafePathError": "smalti.checkpoint.errors",
}

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointUploadError",
    "Checkpointer",
    "ReshardError",
    "UnsafeCheckpointError",
    "UnsafePathError",
]

if _TYPE_CHECKING:  # for type checkers and IDEs; at run time, __getattr__ imports each name on first use
    from smalti.checkpoint.checkpointer import Checkpointer
    from smalti.checkpoint.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointUploadError,
        ReshardError,
        UnsafeCheckpointError,
        UnsafePathError,
    )


def __getattr__(name: str) -> _Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smalti.checkpoint' has no attribute {name!r}")
    value = getattr(_import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
