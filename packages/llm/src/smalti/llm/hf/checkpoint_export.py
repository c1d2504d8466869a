"""Export from a committed smalti-checkpoint: a Hugging Face folder (:func:`export_checkpoint`), or, for a LoRA
run's adapters-only checkpoint, a PEFT adapter folder and the merged model.

Above both :mod:`smalti.llm.hf.exporter` and :mod:`smalti.llm.lora` (the LoRA export writes its merged model
through the Hugging Face exporter), so neither imports the other back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.hf.exporter import (
    checkpoint_tensors,
    export_dtype,
    hf_config,
    tokenizer_files,
    write_hf_folder,
)
from smalti.llm.hf.folder import read_config, resolve_folder
from smalti.llm.hf.registry import llm_config
from smalti.llm.model.config import LLMConfig


def export_checkpoint(checkpoint: str, out: str | os.PathLike, pretrained: str | os.PathLike | None = None,
                      dtype: str | None = None, max_shard_size: int | str = "2GB", verify: str = "manifest",
                      tokenizer: str | None = None, merge: bool = True) -> Path:
    """Write the model of a committed smalti-checkpoint (``checkpoint``: its folder, or a save folder for the
    newest one) as a Hugging Face folder, with the architecture, family and tokenizer of ``pretrained`` (the
    folder the run started from; default: ``model.pretrained`` of the run's ``.hydra/config.yaml``).

    A run trained from scratch (no ``model.pretrained``) is written as the family whose shape its model has (the
    ``mpt_*`` recipes as ``transformers``' GPT-2 with learned positions, or MPT with ALiBi), with ``tokenizer``
    (default: the run's ``data.train.tokenizer``).

    A LoRA run's checkpoint (adapters only) becomes ``out/adapter`` (PEFT's format) and, with ``merge``,
    ``out/hf`` (the base with the adapters merged in); the run's ``model.lora`` settings are needed.
    Returns ``out``."""
    try:
        from smalti.checkpoint.resume import resolve_load_path
    except ImportError as exc:
        raise ConversionError(
            "exporting from a checkpoint needs smalti-checkpoint: pip install smalti-checkpoint"
        ) from exc

    found = resolve_load_path(checkpoint, None, verify)
    run = _run_config(Path(checkpoint))
    if pretrained is None and run is not None and _selected(run, "model.pretrained") is None:
        return _export_trained_from_scratch(found.folder, run, out, dtype, max_shard_size, tokenizer)
    source = resolve_folder(pretrained or _pretrained_of_run(Path(checkpoint)), key="--pretrained")
    if _is_lora(found.folder):
        lora = _selected(run, "model.lora") if run is not None else None
        if lora is None:
            raise ConversionError(f"{found.folder} holds LoRA adapters but no run config with model.lora was found "
                                  "beside it: export from inside the run's folder (its .hydra/config.yaml)")
        from omegaconf import OmegaConf

        from smalti.llm.lora.checkpoint_export import export_lora_checkpoint

        export_lora_checkpoint(found.folder, OmegaConf.to_container(lora, resolve=True), source, out, merge, dtype,
                               max_shard_size)
        return Path(out)
    source_config = read_config(source)
    model_config = llm_config(source_config, source / "config.json").resolved()
    dtype = export_dtype(dtype, source_config)
    family, config = hf_config(_ConfigOnly(model_config), dtype, source=source_config)  # type: ignore[arg-type]
    order = list(family.weight_parts(model_config))
    shapes, tensors = checkpoint_tensors(found.folder, order)
    return write_hf_folder(out, family, model_config, config, shapes, tensors, dtype, max_shard_size, source)


def _run_config(checkpoint: Path) -> Any:
    """The ``.hydra/config.yaml`` of the run a local checkpoint belongs to, or None."""
    from omegaconf import OmegaConf

    for folder in [checkpoint, *checkpoint.resolve().parents][:6]:
        cfg = folder / ".hydra" / "config.yaml"
        if cfg.is_file():
            return OmegaConf.load(cfg)
    return None


def _selected(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def _export_trained_from_scratch(folder: Path, run: Any, out: str | os.PathLike, dtype: str | None,
                                 max_shard_size: int | str, tokenizer: str | None) -> Path:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(run.model, resolve=False)
    if not isinstance(node, dict) or not str(node.get("_target_", "")).endswith("LLM"):
        raise ConversionError(f"{folder}: the run's model ({node.get('_target_') if isinstance(node, dict) else node}) "
                              "is not a smalti LLM; give --pretrained for a model imported from Hugging Face")
    kwargs = {k: v for k, v in node.items() if not k.startswith("_") and k != "init_device"}
    config = LLMConfig.of(kwargs).resolved()
    dtype = export_dtype(dtype, None)
    eos, extra = tokenizer_files(tokenizer or _selected(run, "data.train.tokenizer") or "default")
    family, hf = hf_config(_ConfigOnly(config), dtype, eos_token_id=eos)  # type: ignore[arg-type]  # names misfits
    order = list(family.weight_parts(config))
    shapes, tensors = checkpoint_tensors(folder, order)
    return write_hf_folder(out, family, config, hf, shapes, tensors, dtype, max_shard_size, extra_files=extra)


def _is_lora(folder: Path) -> bool:
    from smalti.checkpoint.safe_load import SafeFileSystemReader
    from smalti.llm.lora.checkpoint_export import is_lora_checkpoint

    return is_lora_checkpoint(SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata)


class _ConfigOnly:
    """Stands in for an :class:`LLM` where only its ``config`` is read."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config


def _pretrained_of_run(checkpoint: Path) -> str:
    """``model.pretrained`` from the ``.hydra/config.yaml`` of the run a local checkpoint belongs to."""
    for folder in [checkpoint, *checkpoint.resolve().parents][:6]:
        cfg = folder / ".hydra" / "config.yaml"
        if cfg.is_file():
            from omegaconf import OmegaConf

            value = OmegaConf.select(OmegaConf.load(cfg), "model.pretrained", default=None)
            if value:
                return str(value)
    raise ConversionError(
        f"--pretrained is needed: no run config (.hydra/config.yaml with model.pretrained) was found above "
        f"{checkpoint}; give the Hugging Face folder the run started from"
    )


