"""Build a :class:`~smalti.core.trainer.Trainer` from a composed ``smalti-train`` config."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from smalti.core import distributed
from smalti.core.config.validate import validate_config
from smalti.core.cpu_malloc import DEFAULT_MMAP_THRESHOLD, configure_cpu_malloc
from smalti.core.data import build_dataloader, check_has_batches, per_rank_batch_size
from smalti.core.errors import BuildError, ConfigError, SmaltiError
from smalti.core.parallelism import Parallelism, SingleDevice
from smalti.core.redact import redact
from smalti.core.run_name import resolve_output_dir
from smalti.core.seed import configure_determinism, seed_all
from smalti.core.trainer import Trainer

log = logging.getLogger(__name__)


def build(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with errors that name the config key whose object failed to build."""
    if node is None or (isinstance(node, DictConfig) and "_target_" not in node):
        return None
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if is_user_error(cause):
            # A package's own check (a missing data path, a bad bucket URL): its message, named by key.
            message = " ".join(str(cause).split())
            raise ConfigError(f"{key} ({node.get('_target_')}): {message}") from cause
        raise ConfigError(f"could not build `{key}` ({node.get('_target_')}): {exc}") from exc


def is_user_error(exc: BaseException | None) -> bool:
    """A deliberate error about the user's input: any smalti package's own error, or smalti-storage's."""
    if isinstance(exc, SmaltiError):
        return True
    return any(cls.__module__.startswith("smalti.storage") and cls.__name__ == "StorageError"
               for cls in type(exc).__mro__)


def build_group(nodes: Any, key: str) -> dict[str, Any]:
    """Build every ``name -> {_target_: ...}`` entry of a list-valued group (loggers, callbacks, ...)."""
    out: dict[str, Any] = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            shown = redact(OmegaConf.to_container(node) if isinstance(node, DictConfig | ListConfig) else node)
            text = OmegaConf.to_yaml(shown) if isinstance(shown, dict | list) else str(shown)
            raise ConfigError(f"`{key}.{name}` must be a mapping with a `_target_`, got {text!r}")
        out[str(name)] = build(node, f"{key}.{name}")
    return out


@contextmanager
def building(part: str) -> Iterator[None]:
    """Turn any error but a :class:`ConfigError` raised while building ``part`` into one :class:`BuildError`.

    The one rule for build-time errors: a user reads one line naming the part and the cause (a config error
    keeps its own message); the cause's traceback stays behind ``HYDRA_FULL_ERROR=1``.
    """
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split()) or "(no message)"
        kind = "" if isinstance(exc, SmaltiError) else f"{type(exc).__name__}: "
        raise BuildError(f"building {part} failed: {kind}{message}") from exc


def build_trainer(cfg: DictConfig) -> Trainer:
    """Check ``cfg`` against the installed schemas, then instantiate every component and return a ready Trainer
    (process group started). A bad value fails here, before anything is built; any other error while building
    the data, the model or the trainer is one :class:`BuildError` naming the part (:func:`building`)."""
    validate_config(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(resolved, dict)
    with building("the parallelism and the data (parallelism, data)"):
        parallelism, train, eval_loader = _build_data(cfg)
    with building("the callbacks (callbacks, health, checkpoint)"):
        callbacks = build_group(cfg.callbacks, "callbacks")
        callbacks.update(build_group(cfg.health, "health"))
        checkpoint = build(cfg.checkpoint, "checkpoint")
        if checkpoint is not None:
            callbacks["checkpoint"] = checkpoint
    with building("the model (model)"):
        model = build(cfg.model, "model")
    with building("the trainer (trainer, optimizer, scheduler, precision)"):
        return _build(cfg, resolved, parallelism, train, eval_loader, callbacks, model)


def _build_data(cfg: DictConfig) -> tuple[Parallelism, Any, Any]:
    parallelism = build(cfg.parallelism, "parallelism") or SingleDevice()
    if not isinstance(parallelism, Parallelism):
        raise ConfigError(f"`parallelism` built a {type(parallelism).__name__}, not a smalti Parallelism")
    parallelism.init_distributed()
    if cfg.trainer.get("deterministic"):
        configure_determinism()  # before anything runs a kernel (oneMKL reads its settings once)
    seed_all(cfg.trainer.seed)  # before the model is built: same initial weights on every rank and run
    # Before the data and the model are built (the Trainer applies it again): what building frees - a checkpoint
    # read in fp32 and quantised, say - goes back to the OS instead of staying in glibc's heap under the run.
    device = cfg.trainer.device
    configure_cpu_malloc(cfg.trainer.get("cpu_malloc_mmap_threshold", DEFAULT_MMAP_THRESHOLD),
                         distributed.default_device() if device is None else device)

    data = cfg.data
    batch_size = per_rank_batch_size(data.global_train_batch_size, parallelism.dp_world_size)
    train = build_dataloader(
        build(data.train, "data.train"),
        batch_size,
        dp_rank=parallelism.dp_rank,
        dp_world_size=parallelism.dp_world_size,
        shuffle=data.shuffle,
        seed=cfg.trainer.seed,
        drop_last=data.drop_last,
        num_workers=data.num_workers,
    )
    if train is None:
        raise ConfigError("`data.train` is empty: choose a data option (data=char_corpus, ...) or set data.train")
    check_has_batches(train, data.global_train_batch_size, parallelism.dp_world_size)  # before the model
    eval_dataset = build(data.eval, "data.eval")
    eval_loader = None
    if eval_dataset is not None:
        eval_loader = build_dataloader(
            eval_dataset,
            per_rank_batch_size(data.eval_batch_size, parallelism.dp_world_size, "data.eval_batch_size"),
            dp_rank=parallelism.dp_rank,
            dp_world_size=parallelism.dp_world_size,
            shuffle=False,
            drop_last=False,
            num_workers=data.num_workers,
        )
    return parallelism, train, eval_loader


def _build(cfg: DictConfig, resolved: dict[Any, Any], parallelism: Parallelism, train: Any, eval_loader: Any,
           callbacks: dict[str, Any], model: Any) -> Trainer:
    t = cfg.trainer
    return Trainer(
        model=model,
        train_dataloader=train,
        max_duration=t.max_duration,
        optimizers=build(cfg.optimizer, "optimizer"),
        schedulers=build(cfg.scheduler, "scheduler"),
        eval_dataloader=eval_loader,
        eval_interval=t.eval_interval,
        eval_subset_num_batches=t.eval_subset_num_batches,
        algorithms=build_group(cfg.algorithms, "algorithms"),
        callbacks=callbacks,
        progress_bar=False,  # the `callbacks` group decides (progress_bar is in its default list)
        loggers=build_group(cfg.logger, "logger"),
        device_train_microbatch_size=t.device_train_microbatch_size,
        precision=t.precision,
        parallelism=parallelism,
        device=t.device,
        seed=t.seed,
        compile=t.compile,
        deterministic=bool(t.get("deterministic", False)),
        log_interval=t.get("log_interval"),
        optimizer_in_backward=bool(t.get("optimizer_in_backward", False)),
        cpu_malloc_mmap_threshold=t.get("cpu_malloc_mmap_threshold", DEFAULT_MMAP_THRESHOLD),
        cpu_gemm=t.get("cpu_gemm", "auto"),
        run_name=cfg.run_name,
        config=resolved,
        output_dir=resolve_output_dir(_root_=cfg),  # hydra.run.dir when set: every file of the run goes there
    )


def run(cfg: DictConfig) -> float:
    """Train the run ``cfg`` describes; return the final training loss (the value sweeps optimise)."""
    trainer = state = None
    try:
        trainer = build_trainer(cfg)
        state = trainer.fit().state
        loss = float(state.batch_loss) if state.batch_loss is not None else float("nan")
        run_name, timestamp = state.run_name, state.timestamp
    finally:
        # The wrapped model (DDP's reducer, FSDP) holds the process group, and the trainer sits in reference
        # cycles: left to the collector at interpreter exit, gloo's worker threads are torn down mid-finalization
        # and the process aborts ("terminate called without an active exception", seen in ~1 of 20 two-rank
        # torchrun runs). Free them while the interpreter is whole, then destroy the group.
        trainer = state = None
        gc.collect()
        distributed.shutdown()
    if distributed.get_rank() == 0:
        log.info("finished %s at %s with loss %.4f", run_name, timestamp, loss)
    return loss
