"""A local Hugging Face model folder: finding it, its ``config.json`` and which safetensors file holds which
tensor. Names read from a file (the safetensors index's ``weight_map``) stay inside the folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError
from smalti.llm.tokenizer import looks_like_hub_name

#: Weight dtypes a folder may be written in (``config.json``'s ``torch_dtype``).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Tokenizer files copied from the source folder to an export, when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
INDEX = "model.safetensors.index.json"


def resolve_folder(pretrained: str | os.PathLike, key: str = "model.pretrained") -> Path:
    """``pretrained`` as an existing local folder with a ``config.json``; a Hub name or a missing folder is an
    error that says smalti reads only local folders and how to get one."""
    folder = Path(os.path.expanduser(str(pretrained)))
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ConversionError(
                f"{key}={str(pretrained)!r}: {folder} has no config.json; give a folder written by "
                "save_pretrained (config.json, *.safetensors and the tokenizer files)"
            )
        return folder
    text = str(pretrained)
    hub_like = looks_like_hub_name(text)
    what = "looks like a Hugging Face Hub name" if hub_like else "is not an existing folder"
    raise ConversionError(
        f"{key}={text!r} {what}: smalti only reads local folders written by save_pretrained and never downloads. "
        f"Download it once, e.g. `huggingface-cli download {text if hub_like else '<org>/<model>'} --local-dir "
        f"./models/{Path(text).name or 'model'}`, then pass {key}=./models/{Path(text).name or 'model'}"
    )


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict (errors name the file)."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return cfg


def _inside(folder: Path, index: Path, tensor: str, file: Any) -> Path:
    """``folder / file`` for an index entry, refusing a name that is not a plain relative path inside ``folder``."""
    if not isinstance(file, str) or not file:
        raise ConversionError(f"{index}: weight_map[{tensor!r}]={file!r} is not a file name")
    path = Path(file)
    # by name only: a Hub cache snapshot's files are symlinks into its blobs folder, which the user chose
    if path.is_absolute() or ".." in path.parts or path.drive:
        raise ConversionError(
            f"{index}: weight_map[{tensor!r}]={file!r} points outside {folder}; an index may only name "
            "safetensors files inside its own folder"
        )
    return folder / path


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConversionError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index}: weight_map must be an object of tensor name -> file name")
        return {name: _inside(folder, index, name, file) for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (it has {bins[0]}: re-save with safe_serialization=True)" if bins else ""
        raise ConversionError(f"{folder} has neither model.safetensors nor {INDEX}{hint}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
