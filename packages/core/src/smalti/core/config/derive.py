"""Config schemas derived from the component they check, so each setting is written once.

A component's constructor states each argument's type, constraint and default once::

    class Profiler(Callback):
        def __init__(self, wait: NonNegativeInt = 5, active: PositiveInt = 3, trace_dir: str | None = None): ...

and :func:`schema_for` reads them back (``inspect.signature`` plus the evaluated type hints) into a pydantic
model for the validator: a schema cannot state a default, a type or a key its component lacks. Rules that span
keys stay hand-written, as ``model_validator`` methods of a small base class passed as ``base``. Components
whose constructor a package does not own (``torch.optim.AdamW``) or may not annotate with pydantic types
(smalti-moe and smalti-streaming stand alone) get their constraints from ``checks``: a type per argument, the
default still read from the signature.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AliasChoices, Field, create_model

from smalti.core.config.types import Schema

__all__ = ["checkable", "schema_for"]

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, Sequence)


def _value_classes() -> tuple[type, ...]:
    """Classes a Python caller may pass where a config gives a plain value (``Time`` for ``"100ba"``); the
    schema accepts their instances as they are."""
    from smalti.core.time import Time

    return (Time,)


def checkable(annotation: Any) -> bool:
    """Whether a config value can be checked against ``annotation`` as written: built from plain values
    (bool, int, float, str, None), ``Literal``, ``Annotated`` constraints, lists, tuples and str-keyed dicts
    of them. Anything else (a module, a callable, a ``Time``) is the builder's business, not the schema's."""
    if annotation in _PLAIN or annotation is Any:
        return annotation is not Any
    if isinstance(annotation, type) and issubclass(annotation, _value_classes()):
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return checkable(get_args(annotation)[0])
    if origin is Literal:
        return True
    if origin in (Union, types.UnionType):
        return all(checkable(arm) for arm in get_args(annotation))
    if origin in _CONTAINERS:
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return all(checkable(a) for a in args) if args else False
    return False


def _hints(function: Callable[..., Any]) -> dict[str, Any]:
    """Each parameter's evaluated annotation; one that names something not importable at run time (a
    ``TYPE_CHECKING`` import) is left out rather than failing the whole signature."""
    try:
        return typing.get_type_hints(function, include_extras=True)
    except (NameError, TypeError):
        pass
    module = sys.modules.get(getattr(function, "__module__", ""), None)
    namespace = dict(vars(module)) if module else {}
    hints: dict[str, Any] = {}
    for name, raw in getattr(function, "__annotations__", {}).items():
        if not isinstance(raw, str):
            hints[name] = raw
            continue
        try:
            hints[name] = eval(raw, namespace)  # noqa: S307 - the module's own annotation text
        except Exception:  # noqa: BLE001 - an unresolvable annotation is simply not checked
            continue
    return hints


def _parameters(target: Any) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """``target``'s named parameters and their types; a class whose ``__init__`` passes ``**kwargs`` on to its
    base class (``HSDP(FSDP)``) gets the base's parameters too."""
    function = target.__init__ if inspect.isclass(target) else target
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    signature = inspect.signature(target)
    parameters = {p.name: p for p in signature.parameters.values() if p.kind not in kinds}
    hints = {k: v for k, v in _hints(function).items() if k in parameters}
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if inspect.isclass(target) and passes_on:
        for parent in target.__mro__[1:]:
            if "__init__" not in vars(parent) or parent is object:
                continue
            more, more_hints = _parameters(parent)
            for key, parameter in more.items():
                if key not in parameters:
                    parameters[key] = parameter
                    if key in more_hints:
                        hints[key] = more_hints[key]
            break
    return parameters, hints


def schema_for(target: Any, *, checks: Mapping[str, Any] | None = None, exclude: Iterable[str] = (),
               aliases: Mapping[str, Iterable[str]] | None = None, base: type[Schema] = Schema,
               name: str | None = None) -> type[Schema]:
    """The config schema of ``target`` (a class or function built from a ``_target_`` node), read off its
    signature: every argument whose type a config value can be checked against becomes a field with that
    type (constraints included) and the signature's default (required when it has none).

    ``checks`` gives the type of arguments whose annotation says too little (a third-party constructor's),
    ``exclude`` leaves arguments to the builder, ``aliases`` accepts other spellings of a key (e.g. the
    MegaBlocks names), ``base`` carries ``model_validator`` rules that span keys. A name in ``checks``,
    ``exclude`` or ``aliases`` that is not an argument of ``target`` is a ``TypeError``: the schema may not
    invent a key.
    """
    parameters, hints = _parameters(target)
    checks, aliases, excluded = dict(checks or {}), dict(aliases or {}), set(exclude)
    label = getattr(target, "__qualname__", repr(target))
    for option, names in (("checks", checks), ("aliases", aliases), ("exclude", excluded)):
        unknown = sorted(set(names) - set(parameters))
        if unknown:
            raise TypeError(f"schema_for({label}, {option}=...): {', '.join(unknown)} is not an argument of "
                            f"{label}; its arguments are {', '.join(parameters)}")
    fields: dict[str, Any] = {}
    for key, parameter in parameters.items():
        if key in excluded:
            continue
        annotation = checks.get(key, hints.get(key))
        if key not in checks and not checkable(annotation):
            continue
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        if key in aliases:
            fields[key] = (annotation, Field(default, validation_alias=AliasChoices(key, *aliases[key])))
        else:
            fields[key] = (annotation, default)
    schema = create_model(name or f"{getattr(target, '__name__', 'Target')}Schema", __base__=base,
                          __module__=base.__module__, **fields)
    schema.__doc__ = f"The options of :class:`{getattr(target, '__module__', '')}.{label}`, read off its signature."
    return schema
