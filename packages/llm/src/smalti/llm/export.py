"""A trained model as a self-contained folder: Hugging Face when the model has a Hugging Face family's shape,
else smalti's own.

* A model with the shape of a registered Hugging Face family (Llama, Mistral, Qwen2, ...; the ``mpt_*`` recipes
  as ``transformers``' GPT-2 or MPT) is written with :func:`smalti.llm.hf.export_hf`: ``transformers`` loads
  the folder offline.
* Any other :class:`~smalti.llm.LLM` (RoPE with LayerNorm, MoE, ...) is written as ``smalti_llm.json`` (the
  model's stored options, :meth:`LLMConfig.architecture <smalti.llm.model.config.LLMConfig.architecture>`) plus ``model.safetensors`` under smalti's parameter names.

Either way a ``tokenizer.json`` can sit beside the weights, and :func:`load_model_folder` reads both layouts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError
from smalti.llm.model.copies import build_with_weights
from smalti.llm.model.transformer import LLM

NATIVE_CONFIG = "smalti_llm.json"


def is_hf_shaped(model: LLM) -> bool:
    """Whether ``model`` has the shape of a registered Hugging Face family, so that the folder can be a Hugging
    Face one."""
    from smalti.llm.hf.registry import exportable

    return exportable(model.config)


def save_model_folder(model: LLM, folder: str | os.PathLike, tokenizer: Any = "default", dtype: str | None = None) -> Path:
    """Write ``model`` (unsharded; see :func:`smalti.llm.model.copies.plain_copy`) to ``folder``; returns the folder.

    ``tokenizer``: a name or path for :func:`smalti.llm.tokenizer.load_tokenizer` whose ``tokenizer.json`` is
    copied beside the weights, or ``None`` (a model imported from Hugging Face brings its own tokenizer files).
    ``dtype``: of the weights; default the source model's (Hugging Face imports), else float32.
    """
    if is_hf_shaped(model):
        from smalti.llm.hf.exporter import export_hf

        return export_hf(model, folder, dtype=dtype, tokenizer=tokenizer)
    from safetensors.torch import save_file

    from smalti.llm.hf.folder import DTYPES as _DTYPES

    dtype = dtype or "float32"
    if dtype not in _DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(_DTYPES[dtype]).contiguous().cpu().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"format": "smalti-llm", "dtype": dtype, "model": model.config.architecture()}
    (folder / NATIVE_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        from smalti.llm.tokenizer import BPETokenizer, load_tokenizer

        tok = load_tokenizer(tokenizer)
        if isinstance(tok, BPETokenizer):
            shutil.copyfile(tok.path, folder / "tokenizer.json")
    return folder


def load_model_folder(folder: str | os.PathLike) -> LLM:
    """Read a folder written by :func:`save_model_folder` (either layout), or any local Hugging Face folder of a
    registered family."""
    folder = Path(folder)
    native = folder / NATIVE_CONFIG
    if not native.is_file():
        from smalti.llm.hf.importer import import_hf

        return import_hf(folder).eval()
    from safetensors.torch import load_file

    try:
        config = json.loads(native.read_text())["model"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ConversionError(f"{native} is not a smalti-llm model config: {exc}") from exc
    state = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    return build_with_weights(config, state, str(folder / "model.safetensors"))
