"""``smalti-train``: compose the run config with Hydra and train.

Runs as one process, or on every rank under ``torchrun ... -m smalti.core.cli.train``. Examples::

    smalti-train optimizer.lr=3e-4 trainer.max_duration=200ba parallelism=ddp logger=[console,jsonl]
    smalti-train -m optimizer.lr=1e-3,3e-3
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from smalti.core.cli.report import install_hydra_exit_code, report_build_error, report_config_error
from smalti.core.config.schema import register_configs
from smalti.core.errors import BuildError, ConfigError
from smalti.core.launch.node import (
    quiet_launcher_schema_notice,
    report_result,
    run_node_agent,
    should_start_agent,
)
from smalti.core.redact import install_log_redaction, remember_secrets

install_log_redaction()  # every log line of this process, Hydra's included, without credentials
remember_secrets(sys.argv[1:])  # secret overrides given on the command line, wherever they are quoted later
register_configs()
quiet_launcher_schema_notice()  # conf/hydra/launcher/submitit_*.yaml match smalti's launcher schemas on purpose
install_hydra_exit_code("smalti-train")


@hydra.main(version_base="1.3", config_path="pkg://smalti.core.conf", config_name="train")
def _train(cfg: DictConfig) -> float:
    try:
        return _checked_train(cfg)
    except (ConfigError, BuildError) as exc:
        # A user's config error: a few lines naming the key, exit code 2; any other error while building the data,
        # the model or the trainer: one line, exit code 1. The traceback only with HYDRA_FULL_ERROR=1.
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(exc, BuildError):
            sys.exit(report_build_error(exc, "smalti-train"))
        sys.exit(report_config_error(exc, "smalti-train"))


def _checked_train(cfg: DictConfig) -> float:
    from smalti.core.config.validate import validate_config

    remember_secrets(_container(cfg))
    validate_config(cfg)  # every value against the installed schemas, before anything is imported or built

    from smalti.core.config.build import run
    from smalti.core.distributed import warn_if_restarts_may_hang
    from smalti.core.run_name import start_hydra_run

    start_hydra_run(cfg)  # refuse autoresume under a generated name; point outputs/latest at this run
    # Scale-out: inside a submitit (Slurm/local) job but not yet under torchrun, start torchrun's agent for this
    # node, which runs this app again on each rank (smalti.core.launch.node). Otherwise train here.
    if should_start_agent():
        return run_node_agent(cfg.run_name)
    warn_if_restarts_may_hang()  # plain torchrun: smalti cannot set the variable for the agent, so it says how
    return report_result(run(cfg))


def _container(cfg: DictConfig) -> object:
    """``cfg`` as plain containers, resolved where it can be (secrets often come from ``${oc.env:...}``)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that fails to resolve is reported by the validation just after
        return OmegaConf.to_container(cfg, resolve=False)


#: Hydra's flags that print the config or the run's settings with ``print`` rather than through logging.
_PRINTING_FLAGS = ("--cfg", "-c", "--info", "-i", "--resolve", "-p", "--package")


def main() -> None:
    """Console-script entry point."""
    if any(arg.split("=", 1)[0] in _PRINTING_FLAGS for arg in sys.argv[1:]):
        import contextlib

        from smalti.core.redact import RedactedStream

        with contextlib.redirect_stdout(RedactedStream(sys.stdout)):
            _train()
        return
    _train()


if __name__ == "__main__":
    main()
