"""smalti-streaming: MDS shards and a deterministic, resumable StreamingDataset from local disk or object storage.

The names below are imported on first use: plugin discovery imports ``smalti.streaming.plugin`` in every
smalti process, and the format alone brings NumPy, the codecs and smalti-storage (the dataset classes also
torch).
"""

# Private aliases keep dir(smalti.streaming) to the public names and the submodules.
from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

_EXPORTS = {
    "DownloadError": "smalti.streaming.errors",
    "MDSWriter": "smalti.streaming.mds",
    "ShardCorruptError": "smalti.streaming.errors",
    "ShardReader": "smalti.streaming.mds",
    "Stream": "smalti.streaming.dataset",
    "StreamingDataLoader": "smalti.streaming.loader",
    "StreamingDataset": "smalti.streaming.dataset",
    "StreamingError": "smalti.streaming.errors",
    "UnsafePathError": "smalti.streaming.errors",
    "UploadError": "smalti.streaming.errors",
    "load_index": "smalti.streaming.mds",
    "merge_index": "smalti.streaming.mds",
    "read_shard_samples": "smalti.streaming.mds",
    "write_parallel": "smalti.streaming.parallel",
}

__all__ = ["DownloadError", "MDSWriter", "ShardCorruptError", "ShardReader", "Stream", "StreamingDataLoader",
           "StreamingDataset", "StreamingError", "UnsafePathError", "UploadError", "load_index", "merge_index",
           "read_shard_samples", "write_parallel"]

if _TYPE_CHECKING:  # for type checkers and IDEs; at run time, __getattr__ imports each name on first use
    from smalti.streaming.dataset import Stream, StreamingDataset
    from smalti.streaming.errors import (
        DownloadError,
        ShardCorruptError,
        StreamingError,
        UnsafePathError,
        UploadError,
    )
    from smalti.streaming.loader import StreamingDataLoader
    from smalti.streaming.mds import MDSWriter, ShardReader, load_index, merge_index, read_shard_samples
    from smalti.streaming.parallel import write_parallel


def __getattr__(name: str) -> _Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smalti.streaming' has no attribute {name!r}")
    value = getattr(_import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
