"""The ``hf_export`` callback: at fit end, the trained model as a Hugging Face folder of its family."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from smalti.core import Callback, distributed
from smalti.llm.hf.exporter import export_dtype, export_model, parse_size
from smalti.llm.model.transformer import LLM

log = logging.getLogger(__name__)


def _run_folder(state: Any) -> Path:
    return Path(state.output_dir)


class HFExport(Callback):
    """At fit end, write the trained model as a Hugging Face folder (``<run folder>/hf`` by default).

    Args:
        folder: where to write; default ``hf`` inside the run's output folder (``outputs/<run>``).
        dtype: ``float32``, ``bfloat16`` or ``float16``; default: the source model's ``torch_dtype``.
        max_shard_size: above this (bytes, or e.g. ``"2GB"``) the weights go into several files with
            ``model.safetensors.index.json``.
        merge: for a LoRA model (``model.lora``), also write the base with the adapters merged in to ``folder``
            (the adapters always go to ``adapter`` beside it, in PEFT's format).
    """

    def __init__(self, folder: str | None = None, dtype: str | None = None, max_shard_size: int | str = "2GB",
                 merge: bool = True) -> None:
        self.folder = folder
        self.merge = merge
        self.dtype = dtype
        self.max_shard_size = max_shard_size
        parse_size(max_shard_size)
        if dtype is not None:
            export_dtype(dtype, None)
        self._done: tuple[int, Path] | None = None
        #: The folder written by the last export (every rank knows it; only rank 0 wrote it).
        self.written: Path | None = None

    def on_fit_end(self, state: Any) -> None:
        self.export(state)

    def export(self, state: Any) -> Path | None:
        """Write the folder for the current training step, once (later calls return the same folder)."""
        batch = int(state.timestamp.batch)
        if self._done is not None and self._done[0] == batch:
            return self._done[1]
        model = state.raw_model
        if not isinstance(model, LLM):
            log.warning("hf_export: the model is a %s, not a smalti-llm LLM; nothing exported", type(model).__name__)
            return None
        out = Path(self.folder) if self.folder else _run_folder(state) / "hf"
        if model.lora_config is not None:
            from smalti.llm.lora.export import export_lora

            export_lora(model, out.parent / "adapter", out if self.merge else None, state.model, self.dtype,
                        self.max_shard_size)
        else:
            export_model(model, out, self.dtype, self.max_shard_size, shard_model=state.model)
        if distributed.is_initialized():
            torch.distributed.barrier()  # no rank goes on (e.g. to log the folder) before rank 0 wrote it
        self._done = (batch, out)
        self.written = out
        if distributed.get_rank() == 0:
            log.info("hf_export: wrote %s", out)
        return out


def find_hf_export(state: Any) -> HFExport | None:
    """The run's :class:`HFExport` callback, or ``None``."""
    manager = getattr(state, "plugin_manager", None)
    for plugin in manager.get_plugins() if manager is not None else ():
        if isinstance(plugin, HFExport):
            return plugin
    return None

