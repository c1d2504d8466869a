"""The errors smalti-checkpoint raises; all subclass :class:`smalti.core.errors.SmaltiError`."""

from __future__ import annotations

from smalti.core.errors import SmaltiError


class CheckpointError(SmaltiError):
    """A checkpoint could not be saved or loaded; the message names the folder or file and the fix."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint fails verification: no valid manifest, a file missing, truncated or with another hash."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UncommittedCheckpointError(CheckpointCorruptError):
    """A checkpoint folder has no manifest: a save was interrupted (or is still running); it is not a checkpoint."""


class CheckpointUploadError(CheckpointError):
    """A file could not be uploaded to (or downloaded from) the object store after every retry."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ReshardError(CheckpointError):
    """Rank-local state (data loader position) cannot follow a change in the number of ranks."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code when read (a pickle wanting a class or function outside the
    allow-list); it is refused unless the user trusts the checkpoint (``checkpoint.trust_pickles=true``)."""

    def __init__(self, message: str, path: str | None = None, wanted: list[str] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.wanted = list(wanted or [])


class UnsafePathError(CheckpointCorruptError):
    """A file name read from a checkpoint file (its manifest) would leave the checkpoint's folder."""
