"""smalti-streaming's config schema: the options of :class:`smalti.streaming.StreamingDataset` (``data=streaming``).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.streaming.plugin`, which only smalti-core calls, so
this module may use smalti-core's :func:`~smalti.core.config.schema_for` (the ``config`` extra); the dataset
itself stays usable without pydantic or smalti-core. The schema is read off the dataset's signature: keys and
defaults come from there; the value ranges its plain annotations cannot state are the ``checks`` below.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from smalti.core.config import schema_for
from smalti.core.config.types import (
    AfterValidator,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Schema,
    field_error,
    model_validator,
)
from smalti.streaming.dataset import BATCHING_METHODS, PARTITION_ALGOS, StreamingDataset
from smalti.streaming.order import SHUFFLES

_SIZE = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*(b|kb|mb|gb|tb)?\s*$", re.IGNORECASE)


def _size(value: Any) -> Any:
    ok = value > 0 if isinstance(value, int) and not isinstance(value, bool) else bool(_SIZE.match(str(value)))
    if not ok:
        raise ValueError("expected a size such as 50gb, 512mb or a number of bytes > 0")
    return value


#: What :class:`~smalti.streaming.StreamingDataset`'s plain annotations cannot say.
STREAMING_CHECKS = {
    "streams": list[Any] | None,
    "batch_size": PositiveInt | None,
    "shuffle_algo": Literal[SHUFFLES] | None,  # type: ignore[valid-type]  # None: keyed, or the checkpoint's
    "shuffle_seed": NonNegativeInt,
    "shuffle_block_size": PositiveInt | None,
    "num_canonical_nodes": PositiveInt | None,
    "partition_algo": Literal[PARTITION_ALGOS],  # type: ignore[valid-type]
    "batching_method": Literal[BATCHING_METHODS],  # type: ignore[valid-type]
    "epoch_size": PositiveInt | None,
    "predownload": NonNegativeInt | None,
    "replication": PositiveInt | None,
    "download_retry": NonNegativeInt,
    "download_timeout": PositiveFloat,
    # A size string is checked only when one is given (ints pass through the same parser).
    "cache_limit": Annotated[int | str, AfterValidator(_size)] | None,
}


class _StreamingRules(Schema):
    @model_validator(mode="after")
    def _local_exists_without_remote(self) -> Schema:
        local = getattr(self, "local", None)
        local_only = getattr(self, "streams", None) is None and getattr(self, "remote", None) is None
        if local_only and local is not None and "://" not in local and not os.path.isdir(os.path.expanduser(local)):
            raise field_error("local", local, "an existing folder of MDS shards (no remote is set to download from)")
        return self


#: :class:`smalti.streaming.StreamingDataset`'s arguments (extra keys are left to the dataset).
StreamingDatasetSchema = schema_for(StreamingDataset, checks=STREAMING_CHECKS, base=_StreamingRules,
                                    name="StreamingDatasetSchema")


def schemas() -> dict[str, type]:
    """What smalti-streaming's ``smalti_config_schemas`` hook returns."""
    return {"smalti.streaming.StreamingDataset": StreamingDatasetSchema}
