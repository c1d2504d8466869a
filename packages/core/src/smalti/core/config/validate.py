"""Check every value of a composed run config against the schemas the installed packages declare.

Runs after Hydra composes the config and before anything is built (no model, data or process group yet).
Schemas come from the ``smalti_config_schemas`` hook: a mapping whose keys are either a top-level section
name without a dot (``trainer``, ``data``), or the ``_target_`` of the nodes a schema checks wherever they
appear (``smalti.llm.LLM`` under ``model``, ``smalti.health.watchdog.HangWatchdog`` under ``health.watchdog``).
Values are pydantic models (see :mod:`smalti.core.config.types`); each gets the whole resolved config as
validation context for rules that span sections. Every problem found is reported in one
:class:`~smalti.core.errors.ConfigError`, one line per key: the full key, the value given, what is expected.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from smalti.core.config.types import FieldError, field_error
from smalti.core.errors import ConfigError

__all__ = ["ConfigValueError", "FieldError", "collect_schemas", "field_error", "resolve", "validate_config"]

#: At most this many problems are listed (plus one line saying how many more), so the report stays short.
MAX_LISTED = 4


class ConfigValueError(ConfigError):
    """One or more config values break their schema; ``problems`` holds one ``key: ...`` line per value."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED]
        if len(self.problems) > MAX_LISTED:
            shown.append(f"... and {len(self.problems) - MAX_LISTED} more")
        super().__init__("\n".join(shown))


def collect_schemas(plugin_manager: Any = None) -> dict[str, list[type]]:
    """Every schema the installed plugins declare, by section name or ``_target_``."""
    from smalti.core.plugins import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    schemas: dict[str, list[type]] = {}
    for result in reversed(pm.hook.smalti_config_schemas()):
        for where, schema in (result or {}).items():
            schemas.setdefault(str(where), []).append(schema)
    return schemas


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with interpolations resolved; a missing (``???``) or unresolvable value
    is a :class:`ConfigValueError` naming its key. ``${hydra:...}`` values are kept as written when no Hydra
    run is active (a config composed in a test or by ``smalti plugins --run``)."""
    resolved = _resolve(cfg, "")
    assert isinstance(resolved, dict)
    return resolved


def _resolve(node: Any, key: str) -> Any:
    if not isinstance(node, DictConfig | ListConfig):
        return node
    if node._is_none():
        return None
    if isinstance(node, DictConfig):
        items: list[tuple[Any, str]] = [(k, f"{key}.{k}" if key else str(k)) for k in node]
    else:
        items = [(i, f"{key}[{i}]") for i in range(len(node))]
    out: Any = {} if isinstance(node, DictConfig) else []
    for k, full in items:
        try:
            value = node[k]
        except MissingMandatoryValue:
            raise ConfigValueError([f"{full}: no value given (???); set it on the command line or in the config"]) from None
        except InterpolationResolutionError as exc:
            missing = re.search(r"Missing mandatory value: (\S+)", str(exc))
            if missing:
                raise ConfigValueError([f"{missing.group(1)}: no value given (???); set it on the command line "
                                        "or in the config"]) from None
            if "HydraConfig was not set" not in str(exc):
                raise ConfigValueError([f"{full}: {str(exc).splitlines()[0]}"]) from None
            from smalti.core._compat import raw_value

            value = raw_value(node, k)
        value = _resolve(value, full)
        if isinstance(out, dict):
            out[str(k)] = value
        else:
            out.append(value)
    return out


def _nodes(node: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every mapping in ``node`` with its full key, depth first."""
    if isinstance(node, Mapping):
        yield key, node  # type: ignore[misc]
        for child_key, child in node.items():
            yield from _nodes(child, f"{key}.{child_key}" if key else str(child_key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _nodes(child, f"{key}[{i}]")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_PHRASES = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "none_required": "null",
    "greater_than": "a value > {gt}", "greater_than_equal": "a value >= {ge}", "less_than": "a value < {lt}",
    "less_than_equal": "a value <= {le}", "list_type": "a list", "tuple_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def _expected(error: Mapping[str, Any]) -> str:
    kind, ctx, msg = error.get("type", ""), error.get("ctx") or {}, str(error.get("msg", ""))
    if kind == "literal_error" and "expected" in ctx:
        choices = str(ctx["expected"]).replace("'", "").replace(" or ", ", ")
        return f"one of: {choices}"
    if kind == "missing":
        return "a value (the key is required)"
    if kind in _PHRASES:
        numbers = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()}
        try:
            return _PHRASES[kind].format(**numbers)
        except (KeyError, IndexError):
            pass
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg.removeprefix("Input should be ").removeprefix("expected ")


def _problems(exc: Any, key: str, node: Mapping[str, Any]) -> list[str]:
    """One line per bad key of ``node``; the alternatives of a union are joined with "or". A ``_partial_: true``
    node may leave required arguments to the caller, so a missing one is not a problem there."""
    found: dict[str, tuple[Any, list[str]]] = {}
    partial = node.get("_partial_") is True
    for error in exc.errors():
        if partial and error.get("type") == "missing":
            continue
        ctx = error.get("ctx") or {}
        path = _config_path(node, error.get("loc", ()))
        cause = ctx.get("error")
        if isinstance(cause, FieldError):
            path, value, expected = path + cause.field.split("."), cause.value, cause.expected
        else:
            value = "(not set)" if error.get("type") == "missing" else error.get("input")
            expected = _expected(error)
        full = key
        for part in path:
            full = f"{full}[{part}]" if part.isdigit() else (f"{full}.{part}" if full else part)
        shown, expectations = found.setdefault(full, (value, []))
        if expected not in expectations:
            expectations.append(expected)
    return [f"{full}={value if value == '(not set)' else _show(value)}: expected {' or '.join(expected)}"
            for full, (value, expected) in found.items()]


def _config_path(node: Any, loc: tuple[Any, ...]) -> list[str]:
    """The config keys along a pydantic error location, without its union and validator labels."""
    path: list[str] = []
    for part in loc:
        if isinstance(node, Mapping) and str(part) in node:
            node = node[str(part)]
            path.append(str(part))
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            path.append(str(part))
        elif isinstance(node, Mapping) and not path and isinstance(part, str) and "[" not in part:
            path.append(part)  # a required key that is absent
    return path


def validate_config(cfg: DictConfig | Mapping[str, Any], plugin_manager: Any = None,
                    world_size: int | None = None) -> dict[str, Any]:
    """Check ``cfg`` against every declared schema; raise :class:`ConfigValueError` listing each bad value.

    Returns the resolved config. ``world_size`` (default ``$WORLD_SIZE`` or 1) feeds divisibility rules.
    """
    from pydantic import ValidationError

    resolved = resolve(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    schemas = collect_schemas(plugin_manager)
    context: dict[str, Any] = {"config": resolved}
    if world_size is not None:
        context["world_size"] = world_size
    problems: list[str] = []
    for key, node in _nodes(resolved, ""):
        wanted = list(schemas.get(key, [])) if "." not in key and key else []
        target = node.get("_target_")
        if isinstance(target, str):
            wanted += schemas.get(target, [])
        for schema in wanted:
            try:
                schema.model_validate(node, context={**context, "key": key})
            except ValidationError as exc:
                problems += [p for p in _problems(exc, key, node) if p not in problems]
    if problems:
        raise ConfigValueError(problems)
    return resolved
