"""smalti-checkpoint's config schema: the ``checkpoint`` options (:class:`smalti.checkpoint.Checkpointer`).

Returned by the ``smalti_config_schemas`` hook of :mod:`smalti.checkpoint.plugin`; checked by smalti-core
after Hydra composes the run and before anything is built.
"""

from __future__ import annotations

import signal
from typing import Annotated, Any, Literal

from smalti.checkpoint.manifest import VERIFY_LEVELS
from smalti.core.config.types import (
    AfterValidator,
    ExistingPath,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Schema,
    TimeStr,
    model_validator,
)
from smalti.core.config.validate import field_error


def _signal(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not hasattr(signal.Signals, str(value).upper()):
        raise ValueError("expected signal names such as SIGTERM, SIGUSR1")
    return value


class CheckpointerSchema(Schema):
    """:class:`smalti.checkpoint.Checkpointer`'s arguments."""

    save_folder: str | None = None
    save_interval: TimeStr | None = "1ep"
    save_on_fit_end: bool = True
    save_on_signal: list[Annotated[int | str, AfterValidator(_signal)]] | None = None
    async_save: bool = False
    keep_last_n: Annotated[int, Field(ge=-1)] = -1
    keep_every_n: PositiveInt | None = None
    load_path: ExistingPath | None = None
    load_weights_only: bool = False
    load_ignore_keys: list[str] | None = None
    load_strict: bool = True
    autoresume: bool = False
    verify: Literal[VERIFY_LEVELS] = "manifest"  # type: ignore[valid-type]
    local_cache_dir: str | None = None
    thread_count: PositiveInt = 1
    direct_io: bool | Literal["read"] = True
    read_ahead_mb: PositiveInt = 64
    load_once: bool = True
    s3_multipart_mb: Annotated[int, Field(ge=5)] = 64
    retry_budget_s: NonNegativeFloat | None = None
    timeout_s: PositiveFloat = 600
    overwrite: bool = False
    trust_pickles: bool = False
    hash: Literal["xxh3_128", "blake3", "sha256"] = "xxh3_128"  # smalti.checkpoint.hashes.ALGORITHMS

    @model_validator(mode="after")
    def _resume_needs_a_folder(self) -> CheckpointerSchema:
        if self.autoresume and not self.save_folder:
            raise field_error("save_folder", self.save_folder, "a folder to resume from when autoresume=true")
        return self


def schemas() -> dict[str, type]:
    """What smalti-checkpoint's ``smalti_config_schemas`` hook returns."""
    return {"smalti.checkpoint.Checkpointer": CheckpointerSchema}
