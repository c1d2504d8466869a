"""Write a smalti :class:`~smalti.llm.LLM` as a Hugging Face folder that ``transformers`` loads offline, for any
registered family: ``config.json`` (the source model's family, or the family whose shape the model has),
``generation_config.json``, the weights
as safetensors (sharded with ``model.safetensors.index.json`` above ``max_shard_size``) and the source's
tokenizer files.

The weights come one tensor at a time, from a live model (gathered from FSDP2 shards by every rank; only rank
0 writes) or from a committed smalti-checkpoint (read key by key): no process holds more than one shard file's
worth of tensors plus the one being converted, and a live model's whole parameters are written by reference, not
copied (only slices of fused tensors, or another dtype, are). The folder is written under a temporary name and renamed into
place, so a half-written export is never seen as complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from smalti.core import distributed
from smalti.llm.errors import ConversionError
from smalti.llm.hf.family import Family
from smalti.llm.hf.folder import DTYPES, TOKENIZER_FILES
from smalti.llm.hf.registry import family_for_config, family_of, llm_config
from smalti.llm.model.transformer import LLM

log = logging.getLogger(__name__)

#: Options a model imported from Hugging Face may change and still be exported under its source config.json
#: (see :attr:`smalti.llm.hf.importer.PretrainedLLM.OVERRIDABLE`).
_OVERRIDABLE = ("max_seq_len", "attn_uses_sequence_id")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"2GB"``, ``"500MB"``, ``"10KiB"`` (decimal units, as
    ``transformers`` counts them)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if match and match.group(2).upper() in _UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise ConversionError(f"hf_export.max_shard_size={value!r} is not a size; give bytes or e.g. '2GB', '500MB'")


def export_dtype(dtype: str | None, source: dict[str, Any] | None) -> str:
    """``dtype``, else the source config's ``torch_dtype``/``dtype``, else ``float32``; checked."""
    chosen = dtype or (source or {}).get("torch_dtype") or (source or {}).get("dtype") or "float32"
    chosen = str(chosen).removeprefix("torch.")
    if chosen not in DTYPES:
        raise ConversionError(f"hf_export.dtype={chosen!r} is not one of {', '.join(DTYPES)}")
    return chosen


class _ShardWriter:
    """Buffers tensors for the current shard file and writes it once its planned tensors are all in."""

    def __init__(self, folder: Path, entries: list[tuple[str, list[int]]], dtype: torch.dtype, max_bytes: int) -> None:
        self.folder, self.dtype = folder, dtype
        size = torch.tensor([], dtype=dtype).element_size()
        self.shards: list[list[str]] = [[]]
        used = 0
        for name, shape in entries:
            nbytes = size * int(torch.Size(shape).numel())
            if self.shards[-1] and used + nbytes > max_bytes:
                self.shards.append([])
                used = 0
            self.shards[-1].append(name)
            used += nbytes
        self.total = sum(size * int(torch.Size(s).numel()) for _, s in entries)
        n = len(self.shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.current = 0
        self.buffer: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        if name not in self.shards[self.current]:
            raise ConversionError(f"export: tensor {name!r} came out of the planned order")
        self.buffer[name] = self._own(tensor.detach())
        if len(self.buffer) == len(self.shards[self.current]):
            save_file(self.buffer, str(self.folder / self.files[self.current]), metadata={"format": "pt"})
            self.buffer = {}
            self._storages = set()
            self.current += 1

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself when it already is what safetensors writes (a CPU tensor of the export dtype that
        is the whole of its storage, shared with no other tensor of this shard: a live model's own parameter),
        else one copy of it (a row slice of a fused tensor, another dtype or device). Buffering a live model's
        parameters by reference keeps a shard's worth of copies (up to ``max_shard_size``) out of the export's
        peak memory, which comes at fit end on top of the weights, gradients and optimizer state."""
        whole = (tensor.device.type == "cpu" and tensor.dtype == self.dtype and tensor.is_contiguous()
                 and tensor.storage_offset() == 0
                 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
        storage = tensor.untyped_storage().data_ptr()
        if whole and storage not in self._storages:
            self._storages.add(storage)
            return tensor
        return tensor.to("cpu", self.dtype, copy=True).contiguous()

    def finish(self) -> None:
        if self.current != len(self.shards):
            raise ConversionError(f"export: only {self.current} of {len(self.shards)} shard files were complete")
        if len(self.shards) > 1:
            weight_map = {name: self.files[i] for i, names in enumerate(self.shards) for name in names}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_hf_folder(
    out: str | os.PathLike,
    family: Family,
    model_config: dict[str, Any],
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    tensors: Iterator[tuple[str, torch.Tensor | None]],
    dtype: str,
    max_shard_size: int | str = "2GB",
    source_folder: Path | None = None,
    write: bool = True,
    extra_files: dict[str, Path | bytes] | None = None,
) -> Path:
    """Write a Hugging Face folder of ``family`` at ``out`` from the tensors of a smalti model with ``model_config``.

    ``shapes``: each smalti parameter's full shape; ``tensors`` yields ``(smalti_name, full tensor)`` in
    ``family.weight_parts`` order (drained on every rank so collectives stay in step; on ranks with
    ``write=False`` the tensors may be ``None``). ``source_folder``: tokenizer files and
    ``generation_config.json`` are copied from it; ``extra_files`` (name -> path to copy, or bytes) are written too.
    """
    out = Path(out)
    parts = family.weight_parts(model_config)
    zeros = family.zero_tensors(model_config)
    entries = [(p.hf_name, p.hf_shape(shapes[name])) for name, ps in parts.items() for p in ps]
    entries += [(name, shape) for name, shape in zeros.items()]
    writer = tmp = None
    if write:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        writer = _ShardWriter(tmp, entries, DTYPES[dtype], parse_size(max_shard_size))
    try:
        for name, tensor in tensors:
            if writer is not None:
                for part in parts[name]:
                    writer.add(part.hf_name, part.of(tensor))
            del tensor
        if writer is None or tmp is None:
            return out
        for name, shape in zeros.items():
            writer.add(name, torch.zeros(shape))
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_generation_config(tmp, config, source_folder)
        for file in TOKENIZER_FILES:
            if source_folder is not None and (source_folder / file).is_file():
                shutil.copyfile(source_folder / file, tmp / file)
        for file, content in (extra_files or {}).items():
            if isinstance(content, bytes):
                (tmp / file).write_bytes(content)
            else:
                shutil.copyfile(content, tmp / file)
        _replace(tmp, out)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_generation_config(folder: Path, config: dict[str, Any], source: Path | None) -> None:
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", folder / "generation_config.json")
        return
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``, replacing an earlier export there."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- sources


def _clean(name: str) -> str:
    """A parameter name without wrapper segments (torch.compile's, activation checkpointing's)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


def model_tensors(model: torch.nn.Module, order: list[str]) -> tuple[dict[str, list[int]], Iterator[tuple[str, Any]]]:
    """Full shapes and a per-parameter iterator of whole tensors of ``model`` (collective under FSDP2: each
    tensor is all-gathered on every rank and kept only by rank 0)."""
    state = {_clean(k): v for k, v in model.state_dict().items()}
    missing = [k for k in order if k not in state]
    if missing:
        raise ConversionError(f"export: the model has no parameter {missing[0]!r}")
    shapes = {k: list(state[k].shape) for k in order}
    keep = distributed.get_rank() == 0

    def gen() -> Iterator[tuple[str, Any]]:
        for name in order:
            value = state[name]
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            yield name, full.detach() if keep else None

    return shapes, gen()


def checkpoint_tensors(folder: Path, order: list[str]) -> tuple[dict[str, list[int]], Iterator[tuple[str, Any]]]:
    """Full shapes and a key-by-key iterator over the model weights of a DCP checkpoint folder (one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # A checkpoint may come from elsewhere: its pickles are read only by smalti-checkpoint's restricted readers.
    from smalti.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner

    metadata = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
    shapes, dtypes = {}, {}
    for name in order:
        meta = metadata.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ConversionError(f"{folder}: the checkpoint has no tensor model.{name}; was it saved from this model?")
        shapes[name], dtypes[name] = list(meta.size), meta.properties.dtype

    def gen() -> Iterator[tuple[str, Any]]:
        for name in order:
            wanted = {f"model.{name}": torch.empty(shapes[name], dtype=dtypes[name])}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)
                dcp.load(wanted, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(),
                         no_dist=True)
            yield name, wanted[f"model.{name}"]

    return shapes, gen()


# ---------------------------------------------------------------------------------------------- config.json


def hf_config(model: LLM, dtype: str = "float32", source: dict[str, Any] | None = None,
              eos_token_id: int | None = None) -> tuple[Family, dict[str, Any]]:
    """The family and ``config.json`` of the Hugging Face model equal to ``model``.

    With ``source`` (the ``config.json`` the model was imported from) the result is that file with the dtype
    set: same family, same fields (after checking that it still describes ``model``). Without, the family is
    the first registered one whose shape the model has.
    """
    if source is None:
        family = family_of(model.config)
        return family, family.hf_config(model.config, dtype, eos_token_id)
    path = Path("the source config.json")
    family = family_for_config(source, path)
    expected = llm_config(source, path).resolved().architecture()
    ours = model.config.architecture()
    changed = [k for k, v in expected.items() if k not in _OVERRIDABLE and ours[k] != v]
    if changed:
        raise ConversionError(f"the model differs from its source config.json in {changed}; cannot export it "
                              "under the source's config")
    out = {k: v for k, v in source.items() if k not in ("_name_or_path", "torch_dtype", "dtype")}
    out["architectures"] = [family.architecture]
    out["torch_dtype" if "torch_dtype" in source else "dtype"] = dtype
    return family, out


def tokenizer_files(tokenizer: Any) -> tuple[int | None, dict[str, Path | bytes]]:
    """The end-of-text id of a smalti tokenizer (a name or path for :func:`smalti.llm.tokenizer.load_tokenizer`)
    and the files that make it load in ``AutoTokenizer`` and lm-evaluation-harness: ``tokenizer.json`` plus
    ``tokenizer_config.json`` and ``special_tokens_map.json`` naming its end-of-text (and padding) token."""
    from smalti.llm.tokenizer import BPETokenizer, load_tokenizer

    tok = load_tokenizer(tokenizer)
    if not isinstance(tok, BPETokenizer):
        return getattr(tok, "eos_id", None), {}
    eos = tok._tok.id_to_token(tok.eos_id)
    pad = tok._tok.id_to_token(tok.pad_id)
    special = {"bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": pad}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000_000,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **special}
    return tok.eos_id, {"tokenizer.json": Path(tok.path),
                        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
                        "special_tokens_map.json": (json.dumps(special, indent=2) + "\n").encode()}


# ---------------------------------------------------------------------------------------------- entry points


def export_model(model: LLM, out: str | os.PathLike, dtype: str | None = None, max_shard_size: int | str = "2GB",
                 source_folder: Path | None = None, source_config: dict[str, Any] | None = None,
                 eos_token_id: int | None = None, shard_model: torch.nn.Module | None = None,
                 extra_files: dict[str, Path | bytes] | None = None) -> Path:
    """Write ``model`` (read through ``shard_model`` when it is the FSDP-wrapped module) to ``out``.

    Collective when the model is sharded: call it on every rank (rank 0 writes). ``source_folder`` and
    ``source_config`` default to those of a :class:`~smalti.llm.hf.PretrainedLLM`.
    """
    source_folder = source_folder or getattr(model, "hf_folder", None)
    source_config = source_config or getattr(model, "hf_config", None)
    dtype = export_dtype(dtype, source_config)
    family, config = hf_config(model, dtype, source=source_config, eos_token_id=eos_token_id)
    parse_size(max_shard_size)
    order = list(family.weight_parts(model.config))
    shapes, tensors = model_tensors(shard_model if shard_model is not None else model, order)
    return write_hf_folder(out, family, model.config, config, shapes, tensors, dtype, max_shard_size, source_folder,
                           write=distributed.get_rank() == 0, extra_files=extra_files)


def export_hf(model: LLM, folder: str | os.PathLike, dtype: str | None = None, tokenizer: Any = None,
              max_shard_size: int | str = "2GB") -> Path:
    """Write ``model`` (unsharded, one process) as a Hugging Face folder of its family (see :func:`export_model`).

    ``tokenizer`` (a name or path for :func:`smalti.llm.tokenizer.load_tokenizer`) puts its ``tokenizer.json``,
    ``tokenizer_config.json`` and special tokens beside the weights; a :class:`~smalti.llm.hf.PretrainedLLM`
    brings its source folder's tokenizer files anyway.
    """
    eos, extra = None, {}
    if tokenizer is not None and getattr(model, "hf_folder", None) is None:
        eos, extra = tokenizer_files(tokenizer)
    return export_model(model, folder, dtype, max_shard_size, eos_token_id=eos, extra_files=extra)
