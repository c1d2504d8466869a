"""Schemas read off a component's signature (``schema_for``): each setting's type, constraint and default is
written once, in the constructor, and the schema can state nothing its component lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import pytest
from pydantic import ValidationError

from smalti.core.config.derive import checkable, schema_for
from smalti.core.config.types import (
    NonNegativeInt,
    PositiveInt,
    Schema,
    TimeOrBatches,
    field_error,
    model_validator,
)
from smalti.core.config.validate import ConfigValueError, validate_config
from smalti.core.plugins import hookimpl
from smalti.core.plugins.manager import new_plugin_manager

if TYPE_CHECKING:
    from torch import nn


class Sampler:
    """A stand-in component with every kind of argument a config sets or leaves to the builder."""

    def __init__(self, count: PositiveInt, every: TimeOrBatches = "10ba", mode: Literal["a", "b"] = "a",
                 skip: NonNegativeInt = 0, label: str | None = None, model: nn.Module | None = None,
                 hook: Any = None) -> None:
        self.count, self.every, self.mode, self.skip, self.label, self.model, self.hook = (
            count, every, mode, skip, label, model, hook)


class Wrapped(Sampler):
    """A subclass that passes ``**kwargs`` on: its schema has its own arguments and its base's."""

    def __init__(self, scale: PositiveInt = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = scale


def test_fields_types_and_defaults_come_from_the_signature():
    schema = schema_for(Sampler)
    assert list(schema.model_fields) == ["count", "every", "mode", "skip", "label"]  # not model, not hook
    assert schema.model_fields["count"].is_required()
    assert {k: f.default for k, f in schema.model_fields.items() if not f.is_required()} == {
        "every": "10ba", "mode": "a", "skip": 0, "label": None}
    schema.model_validate({"count": 3, "every": 5, "model": {"_target_": "x.Y"}, "hook": object()})
    with pytest.raises(ValidationError) as info:
        schema.model_validate({"count": 0, "every": "soon", "mode": "c", "skip": -1})
    assert {error["loc"][0] for error in info.value.errors()} == {"count", "every", "mode", "skip"}


def test_a_base_class_passes_on_its_arguments_through_kwargs():
    schema = schema_for(Wrapped)
    assert list(schema.model_fields) == ["scale", "count", "every", "mode", "skip", "label"]
    with pytest.raises(ValidationError):
        schema.model_validate({"scale": 0, "count": 1})


def test_checks_aliases_and_exclude_may_only_name_arguments():
    with pytest.raises(TypeError, match=r"schema_for\(Sampler, checks=...\): repeat is not an argument"):
        schema_for(Sampler, checks={"repeat": int})
    with pytest.raises(TypeError, match="aliases=...\\): size is not"):
        schema_for(Sampler, aliases={"size": ("n",)})
    schema = schema_for(Sampler, checks={"label": Literal["x"] | None}, exclude=["skip"],
                        aliases={"count": ("n_samples",)})
    assert "skip" not in schema.model_fields
    assert schema.model_validate({"n_samples": 2}).count == 2
    with pytest.raises(ValidationError):
        schema.model_validate({"count": 2, "label": "y"})


def test_rules_that_span_keys_come_from_the_base():
    class Rules(Schema):
        @model_validator(mode="after")
        def _skip_below_count(self) -> Schema:
            if self.skip >= self.count:
                raise field_error("skip", self.skip, f"less than count ({self.count})")
            return self

    schema = schema_for(Sampler, base=Rules)

    class Plugin:
        @hookimpl
        def smalti_config_schemas(self) -> dict[str, type]:
            return {f"{__name__}.Sampler": schema}

    pm = new_plugin_manager()
    pm.register(Plugin())
    with pytest.raises(ConfigValueError, match=r"^sampler.skip=4: expected less than count \(4\)"):
        validate_config({"sampler": {"_target_": f"{__name__}.Sampler", "count": 4, "skip": 4}}, plugin_manager=pm)
    validate_config({"sampler": {"_target_": f"{__name__}.Sampler", "count": 4, "skip": 3}}, plugin_manager=pm)
    with pytest.raises(ConfigValueError, match=r"^sampler.count=\(not set\): expected a value \(the key is required\)"):
        validate_config({"sampler": {"_target_": f"{__name__}.Sampler"}}, plugin_manager=pm)
    # a partial node leaves required arguments to its caller
    validate_config({"sampler": {"_target_": f"{__name__}.Sampler", "_partial_": True}}, plugin_manager=pm)


def test_only_plain_values_are_checked():
    from smalti.core.time import Time

    assert checkable(int) and checkable(list[str]) and checkable(tuple[float, float]) and checkable(str | Time)
    assert not checkable(Any) and not checkable(object) and not checkable(list[Any]) and not checkable(list)
    assert not checkable(int | object)  # a union is checked only when every arm can be


def test_core_components_take_their_constraints_from_their_constructors():
    """The profiler's ``repeat`` was 0 in a hand-written schema and 1 in the callback: now there is one."""
    from smalti.core.callbacks import Profiler
    from smalti.core.config.core_schemas import schemas

    profiler = schemas()["smalti.core.callbacks.Profiler"]
    assert profiler.model_fields["repeat"].default == 1 == Profiler().repeat
    with pytest.raises(ValidationError):
        profiler.model_validate({"active": 0})


def test_the_trainer_and_data_sections_take_their_defaults_from_one_place():
    """``trainer``'s schema defaults are the Trainer's (``max_duration``, required there, the CLI's), and the CLI's
    ``TrainerConfig`` says the same; ``data``'s schema is ``DataConfig``'s. A default changed in one place and
    not the other fails here."""
    import dataclasses
    import inspect

    from smalti.core.config.core_schemas import schemas
    from smalti.core.config.schema import DataConfig, TrainerConfig
    from smalti.core.trainer import Trainer

    found = schemas()
    trainer, data = found["trainer"], found["data"]
    signature = inspect.signature(Trainer).parameters
    config = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
    assert set(trainer.model_fields) == set(config)
    for key, info in trainer.model_fields.items():
        expected = config["max_duration"] if key == "max_duration" else signature[key].default
        assert info.default == expected, key
        assert config[key] == expected, f"TrainerConfig.{key}"
    sections = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.name not in ("train", "eval")}
    assert {key: info.default for key, info in data.model_fields.items()} == sections
    with pytest.raises(ValidationError, match="greater than 0"):
        data(global_train_batch_size=0)
    with pytest.raises(ValidationError, match="dur"):
        trainer(max_duration="0.5dur")
