"""Each setting's default is written once: no config schema states a default its component does not have.

A schema's default is what ``smalti-train --help``-style docs, ``smalti plugins`` and readers of the schema
take as the value when a key is left out; the component's constructor decides what really happens. Every schema
any installed package declares for a ``_target_`` is checked against that target's signature, so a default
changed in one place and not the other fails here (the profiler's ``repeat`` was 0 in its schema and 1 in
:class:`~smalti.core.callbacks.Profiler`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence

from pydantic_core import PydanticUndefined

from smalti.core.config.validate import collect_schemas


def same(a: object, b: object) -> bool:
    """Equal values, counting a list and a tuple of the same items as the same default."""
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str | bytes):
        return not isinstance(b, str | bytes) and list(a) == list(b)
    return a == b and (a is None) == (b is None) and isinstance(a, bool) == isinstance(b, bool)


def default_differences() -> tuple[int, list[str]]:
    """How many (schema field, target parameter) default pairs were compared, and those that differ."""
    compared, differences = 0, []
    for where, schemas in collect_schemas().items():
        if "." not in where:
            continue  # a top-level section (trainer, data, ...), not a component
        module, _, name = where.rpartition(".")
        target = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(target).parameters
        for schema in schemas:
            for field, info in schema.model_fields.items():
                parameter = parameters.get(info.alias or field) or parameters.get(field)
                if parameter is None or parameter.default is inspect.Parameter.empty:
                    continue
                if info.default is PydanticUndefined:
                    continue
                compared += 1
                if not same(info.default, parameter.default):
                    differences.append(f"{where}({field}=...): {schema.__name__} says {info.default!r}, "
                                       f"the constructor {parameter.default!r}")
    return compared, differences


def test_no_schema_default_differs_from_its_components():
    compared, differences = default_differences()
    assert compared > 250  # every package's schemas were found (core alone has over a hundred)
    assert differences == []
