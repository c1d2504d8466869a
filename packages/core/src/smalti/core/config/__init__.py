"""Typed run configs (Hydra structured configs) and building a Trainer from a composed config."""

from smalti.core.config.schema import DataConfig, RunConfig, TrainerConfig, register_configs

__all__ = ["DataConfig", "RunConfig", "TrainerConfig", "register_configs"]
