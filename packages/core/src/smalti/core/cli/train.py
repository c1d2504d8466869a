"""``smalti-train``: compose the run config with Hydra and train.

Runs as one process, or on every rank under ``torchrun ... -m smalti.core.cli.train``. Examples::

    smalti-train optimizer.lr=3e-4 trainer.max_duration=200ba parallelism=ddp logger=[console,jsonl]
    smalti-train -m optimizer.lr=1e-3,3e-3
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from smalti.core.config.schema import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://smalti.core.conf", config_name="train")
def _train(cfg: DictConfig) -> float:
    from smalti.core.config.build import run

    return run(cfg)


def main() -> None:
    """Console-script entry point."""
    _train()


if __name__ == "__main__":
    main()
