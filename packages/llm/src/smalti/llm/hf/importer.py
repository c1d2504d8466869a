"""Read a local Hugging Face folder into smalti's :class:`~smalti.llm.LLM` (``model=hf``), for any registered
family: the family maps ``config.json`` onto the model's arguments (refusing, naming the field, what smalti
cannot reproduce exactly) and names the tensors each parameter is made of.

Weights are read per parameter from the safetensors files (only the rows a rank holds, when FSDP2 has sharded
the parameter), after the model is built on the meta device: no process ever holds a full random or full
fp32 copy before its shard.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError, LoRAError
from smalti.llm.hf.context_length import warn_if_past_positions
from smalti.llm.hf.family import Family
from smalti.llm.hf.folder import read_config, resolve_folder, weight_files
from smalti.llm.hf.registry import family_for_config, llm_config
from smalti.llm.lora.naming import is_adapter_parameter
from smalti.llm.model.transformer import LLM


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The tensor this process fills for ``param`` and the rows of the whole parameter it covers."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ConversionError(f"a parameter is sharded along dim > 0 ({param.placements}); smalti loads row shards")
    return param.to_local(), offset[0], offset[0] + shape[0]


@torch.no_grad()
def load_hf_weights(model: LLM, folder: Path) -> None:
    """Fill ``model``'s parameters (whole, or this rank's FSDP2 shards) from the safetensors in ``folder``,
    reading only the rows each one holds; buffers start at zero."""
    from safetensors import safe_open

    files = weight_files(folder)
    parts = family_for_config(read_config(folder), folder / "config.json").weight_parts(model.config, files)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def open_slice(hf_name: str) -> Any:
            if hf_name not in files:
                raise ConversionError(f"{folder}: missing weight {hf_name!r} (config.json asks for it)")
            path = files[hf_name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path].get_slice(hf_name)

        for name, param in model.named_parameters():
            if is_adapter_parameter(name):
                continue  # LoRA adapters are not in the base's files (finish_adapters fills them)
            if name not in parts:
                raise ConversionError(f"smalti parameter {name!r} has no Hugging Face counterpart")
            local, lo, hi = _local_rows(param)
            for part in parts[name]:
                piece = open_slice(part.hf_name)
                shape, expected = list(piece.get_shape()), part.hf_shape(param.shape)
                if shape != expected:
                    raise ConversionError(f"{files[part.hf_name]}: {part.hf_name} has shape {shape}, config.json "
                                          f"implies {expected}")
                start, stop = max(lo, part.start), min(hi, part.stop)
                if start >= stop:
                    continue
                rows = local[start - lo] if part.stacked else local[start - lo : stop - lo]
                part.view(rows).copy_(part.hf_rows(piece, start, stop, param.dim()))
        for buf in model.buffers():
            buf.zero_()


def _check_expert_lora(family: Family, lora: Any, folder: Path) -> None:
    """Refuse LoRA on the experts of a family whose expert adapters PEFT cannot hold (see
    :attr:`Family.expert_lora_refusal`), naming the family and why."""
    if not lora or family.expert_lora_refusal is None:
        return
    from smalti.llm.lora.config import EXPERT_TARGETS, LoRAConfig

    experts = [t for t in LoRAConfig.from_any(lora).targets if t in EXPERT_TARGETS]
    if experts:
        raise LoRAError(f"model.lora.targets has {experts} but LoRA on the experts of {family.description} "
                        f"({folder}) is not supported: {family.expert_lora_refusal}; remove the expert targets "
                        "or finetune the experts in full (experiment=finetune_hf)")


class PretrainedLLM(LLM):
    """smalti's :class:`LLM` equal to a local Hugging Face folder of a registered family (``model=hf``).

    Built on the meta device: the trainer allocates it (after FSDP2 has sharded it, under ``fsdp``) and calls
    :meth:`init_weights`, which reads each parameter's rows from the folder's safetensors.

    Args:
        pretrained: a local folder written by ``save_pretrained`` (never a Hub name).
        require_tokenizer: refuse a folder without ``tokenizer.json`` (the chat data and the export need it).
        init_device: ``meta`` (the trainer fills it) or ``cpu`` (filled now).
        **overrides: :class:`LLM` arguments that do not change the model's function: ``max_seq_len``,
            ``activation_checkpointing``, ``activation_compression``, ``attn_uses_sequence_id``; and ``lora`` (adapters on the frozen base).
    """

    OVERRIDABLE = ("max_seq_len", "activation_checkpointing", "activation_compression", "attn_uses_sequence_id",
                   "lora")

    def __init__(self, pretrained: str | os.PathLike, require_tokenizer: bool = True, init_device: str = "meta",
                 **overrides: Any) -> None:
        folder = resolve_folder(pretrained)
        source = read_config(folder)
        config = llm_config(source, folder / "config.json")
        bad = sorted(set(overrides) - set(self.OVERRIDABLE))
        if bad:
            raise ConversionError(
                f"model.{bad[0]} cannot be set for model=hf: the architecture comes from {folder / 'config.json'}; "
                f"only {', '.join(self.OVERRIDABLE)} may be given"
            )
        if require_tokenizer and not (folder / "tokenizer.json").is_file():
            raise ConversionError(
                f"{folder} has no tokenizer.json: save the model's tokenizer into the same folder "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(folder)) so that training and the export use it"
            )
        weight_files(folder)  # fail now, not after the model is sharded, when the weights are missing
        _check_expert_lora(family_for_config(source, folder / "config.json"), overrides.get("lora"), folder)
        config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
        warn_if_past_positions(config.max_seq_len, source, folder / "config.json")
        super().__init__(config, init_device="meta")
        #: Where the weights come from, and its ``config.json`` (the export writes the same family).
        self.hf_folder = folder
        self.hf_config = source
        if init_device != "meta":
            self.to_empty(device=init_device)
            self.init_weights()

    def init_weights(self) -> None:
        """Fill every parameter (or this rank's shard of it) with the pretrained weights."""
        load_hf_weights(self, self.hf_folder)
        self.finish_adapters()


def import_hf(folder: str | os.PathLike, **overrides: Any) -> LLM:
    """An :class:`LLM` on the CPU with the weights of a local Hugging Face folder of a registered family
    (``config.json`` + safetensors, such as ``save_pretrained`` writes). ``overrides``: see
    :class:`PretrainedLLM`. Built on meta and filled from the files, so no random copy is made first."""
    return PretrainedLLM(folder, require_tokenizer=False, init_device="cpu", **overrides).train()
