"""smalti-checkpoint: sharded, async, verifiable checkpoints through torch.distributed.checkpoint.

``Checkpointer`` is the callback ``smalti-train checkpoint=dcp`` builds. A checkpoint is a folder
``ep{epoch}-ba{batch}`` whose ``manifest.json`` (sizes and digests of every file: xxh3-128 unless
``checkpoint.hash`` says blake3 or sha256) is written last.
"""

__version__ = "0.1.0"

from smalti.checkpoint.checkpointer import Checkpointer  # noqa: E402
from smalti.checkpoint.errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    CheckpointUploadError,
    ReshardError,
    UnsafeCheckpointError,
    UnsafePathError,
)

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointUploadError", "Checkpointer", "ReshardError",
    "UnsafeCheckpointError", "UnsafePathError",
]
