"""Logger plugins: console, JSONL file, MLflow, W&B and TensorBoard (the last three are extras, imported on first use)."""

from typing import Any

from smalti.core.loggers.console import ConsoleLogger
from smalti.core.loggers.jsonl import JSONLLogger, read_jsonl
from smalti.core.loggers.queued import QueuedLoggerDestination

__all__ = ["ConsoleLogger", "JSONLLogger", "MLflowLogger", "QueuedLoggerDestination", "TensorBoardLogger", "WandBLogger", "read_jsonl"]


def __getattr__(name: str) -> Any:
    if name == "MLflowLogger":
        from smalti.core.loggers.mlflow import MLflowLogger

        return MLflowLogger
    if name == "WandBLogger":
        from smalti.core.loggers.wandb import WandBLogger

        return WandBLogger
    if name == "TensorBoardLogger":
        from smalti.core.loggers.tensorboard import TensorBoardLogger

        return TensorBoardLogger
    raise AttributeError(name)
