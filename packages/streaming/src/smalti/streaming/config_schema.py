"""smalti-streaming's config schema: the options of :class:`smalti.streaming.StreamingDataset` (``data=streaming``).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.streaming.plugin`, which only smalti-core
calls: the schema is a pydantic model (pydantic comes with smalti-core), and smalti-streaming itself stays
usable without either.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from smalti.streaming.dataset import BATCHING_METHODS, PARTITION_ALGOS
from smalti.streaming.order import SHUFFLES

Positive = Annotated[int, Field(gt=0)]


_SIZE = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*(b|kb|mb|gb|tb)?\s*$", re.IGNORECASE)


def _size(value: Any) -> Any:
    ok = value > 0 if isinstance(value, int) and not isinstance(value, bool) else bool(_SIZE.match(str(value)))
    if not ok:
        raise ValueError("expected a size such as 50gb, 512mb or a number of bytes > 0")
    return value


class StreamingDatasetSchema(BaseModel):
    """:class:`smalti.streaming.StreamingDataset`'s arguments (extra keys are left to the dataset)."""

    model_config = ConfigDict(extra="allow")

    streams: list[Any] | None = None
    remote: str | None = None
    local: str | None = None
    split: str | None = None
    batch_size: Positive | None = None
    shuffle: bool = False
    shuffle_algo: Literal[SHUFFLES] | None = None  # type: ignore[valid-type]  # None: blocks, or the checkpoint's
    shuffle_seed: Annotated[int, Field(ge=0)] = 9176
    shuffle_block_size: Positive | None = None
    num_canonical_nodes: Positive | None = None
    partition_algo: Literal[PARTITION_ALGOS] = "relaxed"  # type: ignore[valid-type]
    batching_method: Literal[BATCHING_METHODS] = "random"  # type: ignore[valid-type]
    epoch_size: Positive | None = None
    predownload: Annotated[int, Field(ge=0)] | None = None
    replication: Positive | None = None
    download_retry: Annotated[int, Field(ge=0)] = 2
    download_timeout: Annotated[float, Field(gt=0)] = 60.0
    validate_hash: bool = True

    # A size string is checked only when one is given (ints pass through the same parser).
    cache_limit: Annotated[int | str, AfterValidator(_size)] | None = None

    @field_validator("local")
    @classmethod
    def _local_exists_without_remote(cls, local: str | None, info: ValidationInfo) -> str | None:
        local_only = info.data.get("streams") is None and info.data.get("remote") is None
        if local_only and local is not None and "://" not in local and not os.path.isdir(os.path.expanduser(local)):
            raise ValueError("an existing folder of MDS shards (no remote is set to download from)")
        return local


def schemas() -> dict[str, type]:
    """What smalti-streaming's ``smalti_config_schemas`` hook returns."""
    return {"smalti.streaming.StreamingDataset": StreamingDatasetSchema}
