"""YAML sets only what differs: no config file restates a default its ``_target_``'s constructor already has.

A default is written once, in the component (:mod:`smalti.core.config.derive`); a YAML copy of it goes stale
the day the constructor changes (the profiler's ``repeat`` was 1 in the callback, 0 in its schema, and the
YAML hid the difference). A key may stay only when it is a documented command-line knob: Hydra sets an existing
key with ``key=value`` but needs ``+key=value`` for one the file does not have, so removing it would break the
commands the READMEs show. Those keys are listed in :data:`KNOBS` with where they are documented.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "health", "checkpoint", "moe", "streaming", "llm")

#: Keys that restate their component's default on purpose: each is set on the command line without ``+`` in
#: the README, test, bench or config error named beside it, or pairs with a key beside it. Each must still
#: equal the default (:func:`test_every_knob_is_still_a_yaml_key_equal_to_the_default`), so a changed
#: constructor default cannot be masked by a stale YAML copy.
KNOBS: dict[str, str] = {
    'algorithms.ema.half_life': 'half_life is named by its config error (ema.py)',
    'algorithms.ema.smoothing': 'smoothing is named by its config error (ema.py)',
    'algorithms.float8.recipe': 'recipe is named by its config error (float8.py)',
    'algorithms.float8.skip': 'skip is named by its config error (float8.py)',
    'algorithms.gradient_clipping.clipping_threshold': 'clipping_threshold is named by its config error (grad_clip.py)',
    'algorithms.gradient_clipping.clipping_type': 'clipping_type is named by its config error (grad_clip.py)',
    'algorithms.label_smoothing.smoothing': 'smoothing is named by its config error (label_smoothing.py)',
    'algorithms.layer_freezing.freeze_level': 'freeze_level is named by its config error (layer_freezing.py)',
    'algorithms.layer_freezing.freeze_start': 'freeze_start is named by its config error (layer_freezing.py)',
    'algorithms.sam.epsilon': 'epsilon is named by its config error (sam.py)',
    'algorithms.sam.interval': 'set as interval=... in callback_cost.py',
    'algorithms.sam.rho': 'rho is named by its config error (sam.py)',
    'algorithms.seq_length_warmup.duration': 'duration is named by its config error (seq_length_warmup.py)',
    'algorithms.seq_length_warmup.min_seq_length': 'min_seq_length is named by its config error (seq_length_warmup.py)',
    'algorithms.seq_length_warmup.step_size': 'step_size is named by its config error (seq_length_warmup.py)',
    'algorithms.swa.anneal_steps': 'anneal_steps is named by its config error (swa.py)',
    'algorithms.swa.anneal_strategy': 'anneal_strategy is named by its config error (swa.py)',
    'algorithms.swa.bn_update_batches': 'bn_update_batches is named by its config error (swa.py)',
    'algorithms.swa.swa_lr': 'swa_lr is named by its config error (swa.py)',
    'algorithms.swa.swa_start': 'set as swa_start=... in callback_cost.py',
    'callbacks.activation_monitor.stats': 'stats is named by its config error (activation_monitor.py)',
    'callbacks.early_stopping.min_delta': 'min_delta is named by its config error (early_stopping.py)',
    'callbacks.early_stopping.mode': 'mode is named by its config error (early_stopping.py)',
    'callbacks.early_stopping.patience': 'patience is named by its config error (early_stopping.py)',
    'callbacks.goodput.flush_interval_s': 'set as flush_interval_s=... in packages/core/README.md',
    'callbacks.loss_spike.action': 'action is named by its config error (loss_spike.py)',
    'callbacks.loss_spike.max_rollbacks': 'max_rollbacks is named by its config error (loss_spike.py)',
    'callbacks.loss_spike.outlier_multiplier': 'outlier_multiplier is named by its config error (loss_spike.py)',
    'callbacks.loss_spike.patience': 'patience is named by its config error (loss_spike.py)',
    'callbacks.loss_spike.window_size': 'window_size is named by its config error (loss_spike.py)',
    'callbacks.moe_bias_update.coeff': 'set as coeff=... in test_config_values.py',
    'callbacks.nan_guard.action': 'action is named by its config error (nan_guard.py)',
    'callbacks.nan_guard.max_skips': 'max_skips is named by its config error (nan_guard.py)',
    'callbacks.profiler.active': 'set as active=... in test_cli.py',
    'callbacks.profiler.trace_dir': 'set as trace_dir=... in test_redaction.py',
    'callbacks.profiler.wait': 'set as wait=... in test_cli.py',
    'callbacks.profiler.warmup': 'set as warmup=... in test_cli.py',
    'callbacks.progress_bar.force': 'set as force=... in test_redaction.py',
    'callbacks.runtime_estimator.window_size': 'window_size is named by its config error (runtime_estimator.py)',
    'callbacks.speed_monitor.window_size': 'window_size is named by its config error (speed_monitor.py)',
    'checkpoint.async_save': 'set as async_save=... in test_kill_resume.py',
    'checkpoint.autoresume': 'set as autoresume=... in README.md',
    'checkpoint.direct_io': 'direct_io is named by its config error (checkpointer.py)',
    'checkpoint.hash': 'hash is named by its config error (hashes.py)',
    'checkpoint.keep_last_n': 'set as keep_last_n=... in test_retention.py',
    'checkpoint.load_path': 'set as load_path=... in test_config_values.py',
    'checkpoint.load_strict': 'fine-tuning from a checkpoint sets it (checkpoint README)',
    'checkpoint.load_weights_only': 'fine-tuning from a checkpoint sets it (checkpoint README)',
    'checkpoint.local_cache_dir': 'set as local_cache_dir=... in test_retention.py',
    'checkpoint.overwrite': 'set as overwrite=... in packages/checkpoint/README.md',
    'checkpoint.save_interval': 'set as save_interval=... in README.md',
    'checkpoint.save_on_fit_end': 'set as save_on_fit_end=... in test_host_syncs.py',
    'checkpoint.thread_count': 'set as thread_count=... in test_config_values.py',
    'checkpoint.timeout_s': 'the collective time-out users raise for large saves',
    'checkpoint.trust_pickles': 'set as trust_pickles=... in README.md',
    'checkpoint.verify': 'verify is named by its config error (checkpointer.py)',
    'data.eval.batch_size': "streaming's per-rank batch size, set when the loader's differs",
    'data.eval.seq_len': 'char_corpus sets train and eval lengths side by side',
    'data.eval.shuffle': "streaming's train and eval shuffle side by side",
    'data.train.batch_size': "streaming's per-rank batch size, set when the loader's differs",
    'data.train.cache_limit': 'set as cache_limit=... in test_config_values.py',
    'data.train.download_timeout': 'set as download_timeout=... in test_config_values.py',
    'data.train.partition_algo': 'set as partition_algo=... in test_config_values.py',
    'data.train.remote': 'set as remote=... in streaming.yaml',
    'data.train.seed': "synthetic data's train seed beside the eval seed (1): the split depends on both",
    'data.train.seq_len': 'char_corpus sets train and eval lengths side by side',
    'data.train.shuffle_algo': 'set as shuffle_algo=... in test_config_values.py',
    'data.train.split': "char_corpus names each side's split beside the eval one",
    'health.gpu_monitor.interval_s': 'interval_s is named by its config error (gpu_monitor.py)',
    'health.mfu_alarm.action': 'action is named by its config error (mfu_alarm.py)',
    'health.mfu_alarm.min_samples_per_sec': "the alarm's floor; its config error asks for it or min_mfu",
    'health.straggler.factor': 'set as factor=... in test_config_values.py',
    'health.watchdog.grace_s': 'set as grace_s=... in test_health_restart.py',
    'health.watchdog.poll_s': 'set as poll_s=... in test_config_values.py',
    'health.watchdog.report_dir': 'set as report_dir=... in test_health_restart.py',
    'health.watchdog.timeout_s': 'set as timeout_s=... in packages/health/README.md',
    'hydra.callbacks.redact_run_files.subdir': 'set as subdir=... in train.yaml',
    'logger.console.log_interval': 'set as log_interval=... in test_redaction.py',
    'logger.mlflow.experiment_name': 'set as experiment_name=... in test_redaction.py',
    'model.d_model': 'd_model is named by its config error (core_schemas.py)',
    'model.depth': 'set as depth=... in test_config_values.py',
    'model.dropout': 'set as dropout=... in conftest.py',
    'model.hidden': 'test_config_values.py sets cfg.model.hidden on the composed config',
    'model.in_features': "pairs with data=synthetic's in_features (change both)",
    'model.max_seq_len': 'set as max_seq_len=... in README.md',
    'model.n_heads': 'n_heads is named by its config error (config_schema.py)',
    'model.n_layers': 'set as n_layers=... in test_recipes.py',
    'model.out_features': "pairs with data=synthetic's out_features (change both)",
    'model.vocab_size': 'set as vocab_size=... in test_recipes.py',
    'optimizer.betas': 'set as betas=... in sft_vs_trl.py',
    'optimizer.lr': 'set as lr=... in README.md',
    'parallelism.param_dtype': 'set as param_dtype=... in packages/llm/README.md',
    'parallelism.reduce_dtype': 'set as reduce_dtype=... in packages/llm/README.md',
    'parallelism.reduce_every_microbatch': 'set as reduce_every_microbatch=... in packages/core/README.md',
    'parallelism.replicate': 'replicate is named by its config error (fsdp.py)',
    'parallelism.shard': 'shard is named by its config error (fsdp.py)',
    'scheduler.alpha_f': 'alpha_f is named by its config error (schedulers.py)',
    'checkpoint.keep_every_n': 'the retention knob beside keep_last_n; read as cfg.keep_every_n by test_retention.py',
    'checkpoint.read_ahead_mb': 'documented in packages/checkpoint/README.md (the load read-ahead)',
    'checkpoint.load_once': 'documented in packages/checkpoint/README.md (load_once: false for HSDP)',
    'checkpoint.retry_budget_s': 'documented as checkpoint.retry_budget_s in packages/checkpoint/README.md',
    'checkpoint.s3_multipart_mb': 'documented in packages/checkpoint/README.md (multipart uploads)',
    # smalti-llm
    'callbacks.gauntlet.tasks': 'set as callbacks.gauntlet.tasks=... in its file\'s comment and packages/llm/README.md',
    'callbacks.hf_export.folder': 'documented beside the key (null: <run>/hf)',
    'callbacks.hf_export.dtype': 'documented beside the key (the choices)',
    'callbacks.hf_export.max_shard_size': 'named in the file\'s comment',
    'callbacks.hf_export.merge': 'set as callbacks.hf_export.merge=... in packages/llm/README.md',
    'callbacks.mlflow_model.registered_model_name': 'named in the file\'s comment (default: the run name)',
    'callbacks.mlflow_model.interval': 'set as interval=... in packages/llm/README.md, documented beside the key',
    'data.train.packing': 'the chat recipe\'s packing is read as data.train.packing by test_long_context_config.py',
    'data.eval.packing': 'pairs with data.train.packing (data/chat.yaml)',
    'data.train.overlong': 'documented beside the key in data/chat.yaml (truncate or drop)',
    'data.eval.overlong': 'pairs with data.train.overlong',
    'data.train.path': 'set as data.train.path=... in the finetune_hf experiments and packages/llm/README.md',
    'data.eval.path': 'set as data.eval.path=... in bench/sft_vs_trl.py',
    'data.train.vocab_size': 'pairs with the model\'s vocab_size (data/markov.yaml)',
    'data.eval.vocab_size': 'pairs with data.train.vocab_size',
    'data.eval.remote': 'pairs with data.train.remote (data/text_mds.yaml)',
    'model.position': 'set as model.position=... in packages/llm/tests/test_plan.py; a model file states its architecture',
    'model.norm_type': 'set as model.norm_type=... in packages/core/README.md; a model file states its architecture',
    'model.ffn_type': 'named as model.ffn_type=... in model/ffn.py; a model file states its architecture',
    'model.init_device': 'set as model.init_device=... in packages/llm/tests/test_recipes.py',
}


def _nodes(node: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield key, node
        for child_key, child in node.items():
            yield from _nodes(child, f"{key}.{child_key}" if key else str(child_key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _nodes(child, f"{key}[{i}]")


def same(given: object, default: object) -> bool:
    """The YAML value is the default: equal, a list for a tuple, an int for a float, never a bool for a number."""
    if isinstance(given, Sequence) and isinstance(default, Sequence) and not isinstance(given, str | bytes):
        return not isinstance(default, str | bytes) and list(given) == list(default)
    return given == default and (given is None) == (default is None) and isinstance(given, bool) == isinstance(
        default, bool) and isinstance(given, str) == isinstance(default, str)


def _package_path(path: Path, conf: Path) -> str:
    """Where a config group file's content lands in the run config (``callbacks/profiler.yaml`` -> ``callbacks``)."""
    text = path.read_text()
    if "@package _global_" in text:
        return ""
    return ".".join(path.relative_to(conf).parent.parts)


def restated_defaults() -> tuple[int, list[str], list[str]]:
    """How many YAML component keys were compared with their target's default, the config paths that restate
    one (``callbacks.profiler.wait (callbacks/profiler.yaml: ...)``), and the knobs that no longer equal it."""
    compared, restated, differing, equal = 0, [], {}, set()
    for package in PACKAGES:
        conf = ROOT / "packages" / package / "src" / "smalti" / package / "conf"
        for path in sorted(conf.rglob("*.yaml")):
            prefix = _package_path(path, conf)
            for key, node in _nodes(yaml.safe_load(path.read_text()) or {}, prefix):
                target = node.get("_target_")
                if not isinstance(target, str):
                    continue
                module, _, name = target.rpartition(".")
                parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters
                for option, value in node.items():
                    parameter = parameters.get(str(option))
                    if parameter is None or parameter.default is inspect.Parameter.empty:
                        continue
                    compared += 1
                    full = f"{key}.{option}" if key else str(option)
                    if same(value, parameter.default) and full not in KNOBS:
                        restated.append(f"{full} ({path.relative_to(conf)}: {value!r} is {target}'s default)")
                    elif full in KNOBS:
                        if same(value, parameter.default):
                            equal.add(full)
                        else:  # a knob's path may be a deliberate override in another file (optimizer.lr)
                            differing[full] = (f"{full} ({path.relative_to(conf)}: {value!r}, {target}'s default is "
                                               f"{parameter.default!r})")
    return compared, restated, [line for full, line in differing.items() if full not in equal]


def test_no_yaml_key_restates_its_targets_default():
    compared, restated, _ = restated_defaults()
    assert compared > 20  # the walk found the packages' component files
    assert restated == [], "remove these keys (or list a documented command-line knob in KNOBS):\n" + "\n".join(
        restated)


def test_every_knob_is_still_a_yaml_key_equal_to_the_default():
    """An allowance outlives nothing: a knob listed here must still be in a file and still equal the default
    (when a constructor's default changes, change the YAML with it, or make the YAML value a deliberate override
    and drop it from :data:`KNOBS`)."""
    _, _, stale = restated_defaults()
    assert stale == []
    found = set()
    for package in PACKAGES:
        conf = ROOT / "packages" / package / "src" / "smalti" / package / "conf"
        for path in conf.rglob("*.yaml"):
            prefix = _package_path(path, conf)
            for key, node in _nodes(yaml.safe_load(path.read_text()) or {}, prefix):
                if isinstance(node.get("_target_"), str):
                    found.update(f"{key}.{option}" if key else str(option) for option in node)
    assert sorted(set(KNOBS) - found) == []
