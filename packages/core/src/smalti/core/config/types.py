"""Building blocks for config schemas: a pydantic base class and the value types smalti's options share.

Components annotate their constructor's arguments with these types (``interval: TimeOrBatches = "10ba"``),
and :func:`smalti.core.config.derive.schema_for` reads the schema off the signature. A schema is a pydantic
model of one config node (a section such as ``trainer``, or every node whose ``_target_`` is a given class). Packages return them from the ``smalti_config_schemas`` hook; see
:mod:`smalti.core.config.validate` for how they are applied. Example::

    from typing import Literal
    from smalti.core.config.derive import schema_for
    from smalti.core.config.types import Probability, TimeStr

    class Dropout(Algorithm):
        def __init__(self, p: Probability = 0.1, every: TimeStr = "1ba",
                     mode: Literal["row", "element"] = "element") -> None: ...

    schemas = {"my_package.Dropout": schema_for(Dropout)}  # what the smalti_config_schemas hook returns
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from smalti.core.errors import TimeError

# pydantic's pieces a schema needs are re-exported, so a package that depends on smalti-core writes its
# schemas without importing pydantic itself.
__all__ = [
    "AfterValidator",
    "ExistingPath",
    "Field",
    "IntFromMinusOne",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "ProperFraction",
    "Schema",
    "TimeOrBatches",
    "TimeOrFraction",
    "TimeStr",
    "ValidationInfo",
    "model_validator",
    "run_config",
    "world_size",
]


class Schema(BaseModel):
    """Base class of config schemas: keys the schema does not name (``_target_``, ``_partial_``, builder
    arguments without a rule) are allowed; values are checked, not converted (the builder gets the config)."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True, populate_by_name=True)


def _time(value: Any) -> Any:
    from smalti.core.time import Time

    try:
        Time.parse(value)
    except TimeError:
        raise ValueError("expected a time such as 100ba, 2ep, 5000sp, 2e9tok or 0.1dur") from None
    return value


def _time_or_batches(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a time such as 100ba, 2ep or 0.1dur, or a number of batches")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("expected a time such as 100ba, 2ep or 0.1dur, or a number of batches >= 0")
        return value
    return _time(value)


def _existing_path(value: Any) -> Any:
    if value is not None and "://" not in str(value) and not os.path.exists(os.path.expanduser(str(value))):
        raise ValueError("expected an existing file or folder (no such path)")
    return value


#: A time string: ``"100ba"``, ``"2ep"``, ``"5000sp"``, ``"2e9tok"``, ``"0.1dur"``.
TimeStr = Annotated[str, AfterValidator(_time)]
#: A time string, or a bare non-negative int read as batches (intervals).
TimeOrBatches = Annotated[int | str, AfterValidator(_time_or_batches)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
#: A probability or fraction in [0, 1].
Probability = Annotated[float, Field(ge=0, le=1)]
#: A fraction in [0, 1): a decay, a smoothing or a dropout rate.
ProperFraction = Annotated[float, Field(ge=0, lt=1)]
#: A count where -1 means "all" or "work it out" (a mesh dimension's size, how many checkpoints to keep).
IntFromMinusOne = Annotated[int, Field(ge=-1)]
#: A time string, or a plain number read as a fraction of the run (``0.5`` is ``0.5dur``).
TimeOrFraction = TimeStr | NonNegativeFloat
#: A local path that must exist (URLs such as ``s3://...`` are not checked here).
ExistingPath = Annotated[str, AfterValidator(_existing_path)]


def run_config(info: ValidationInfo) -> dict[str, Any]:
    """The whole resolved run config, for rules that span sections (e.g. ``model.n_heads`` vs ``parallelism.sp``)."""
    return dict((info.context or {}).get("config") or {})


def world_size(info: ValidationInfo) -> int:
    """The number of ranks the run will have (``$WORLD_SIZE`` under torchrun, else 1), for divisibility rules."""
    context = info.context or {}
    if "world_size" in context:
        return int(context["world_size"])
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class FieldError(ValueError):
    """A rule spanning keys was broken; raised from a schema's ``model_validator`` (see :func:`field_error`)."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"{field}={value!r}: expected {expected}")
        self.field, self.value, self.expected = field, value, expected


def field_error(field: str, value: Any, expected: str) -> FieldError:
    """An error for a rule that spans keys, raised from a schema's ``model_validator``, naming the key at fault.

    ``field`` is relative to the node the schema checks (``"n_heads"``, or ``"moe.top_k"``)::

        raise field_error("n_heads", self.n_heads, f"a multiple of parallelism.sp={sp}")
    """
    return FieldError(field, value, expected)
