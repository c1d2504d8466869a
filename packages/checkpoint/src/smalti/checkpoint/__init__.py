"""smalti-checkpoint: sharded, async, verifiable checkpoints through torch.distributed.checkpoint.

``Checkpointer`` is the callback ``smalti-train checkpoint=dcp`` builds. A checkpoint is a folder
``ep{epoch}-ba{batch}`` whose ``manifest.json`` (sizes and digests of every file: xxh3-128 unless
``checkpoint.hash`` says blake3 or sha256) is written last.

The names below are imported on first use: plugin discovery imports ``smalti.checkpoint.plugin`` in every
smalti process, and importing ``Checkpointer`` pulls in torch's FSDP and DCP modules (seconds of start-up).
"""

# Private aliases keep dir(smalti.checkpoint) to the public names and the submodules.
from typing import TYPE_CHECKING as _TYPE_CHECKING

from smalti.core.lazy import lazy_exports as _lazy_exports

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


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
