"""smalti-streaming: MDS shards and a deterministic, resumable StreamingDataset from local disk or object storage."""

__version__ = "0.1.0"

from smalti.streaming.errors import (  # noqa: E402
    DownloadError,
    ShardCorruptError,
    StreamingError,
    UnsafePathError,
    UploadError,
)
from smalti.streaming.mds import MDSWriter, ShardReader, load_index, merge_index, read_shard_samples  # noqa: E402
from smalti.streaming.parallel import write_parallel  # noqa: E402

__all__ = ["DownloadError", "MDSWriter", "ShardCorruptError", "ShardReader", "Stream", "StreamingDataLoader",
           "StreamingDataset", "StreamingError", "UnsafePathError", "UploadError", "load_index", "merge_index",
           "read_shard_samples", "write_parallel"]


def __getattr__(name: str):
    """Import torch only when the dataset classes are used: the format and CLI work without it."""
    if name in ("StreamingDataset", "Stream"):
        from smalti.streaming import dataset

        return getattr(dataset, name)
    if name == "StreamingDataLoader":
        from smalti.streaming.loader import StreamingDataLoader

        return StreamingDataLoader
    raise AttributeError(name)
