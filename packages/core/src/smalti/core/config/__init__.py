"""Typed run configs (Hydra structured configs), config schemas read off components' signatures, and building a
Trainer from a composed config."""

from smalti.core.config.derive import schema_for
from smalti.core.config.schema import DataConfig, RunConfig, TrainerConfig, register_configs

__all__ = ["DataConfig", "RunConfig", "TrainerConfig", "register_configs", "schema_for"]
