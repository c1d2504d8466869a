"""What a Hugging Face family module provides: the interface the importer, the exporter and the registry use.

A family is one ``model_type`` of ``transformers`` (``llama``, ``qwen3``, ``mpt``, ...). Its module says

* which ``config.json`` fields it reads and how they map onto :class:`~smalti.llm.LLM`'s arguments, refusing
  (with :class:`~smalti.llm.errors.ConversionError` naming the field) any value smalti cannot reproduce exactly;
* which smalti models have its shape (:meth:`Family.problems`) and the ``config.json`` that describes one;
* its weight names both ways, as :class:`Part` lists: each smalti parameter is made of one or more Hugging Face
  tensors (fused q/k/v stacked by rows, a transposed ``Conv1D`` weight, or one expert of a stacked MoE tensor).

Mixture-of-experts families declare ``ffn = "moe"`` and map each expert's tensor with ``stacked=True`` parts
onto the rows of smalti-moe's stacked expert weights, so the importer and exporter need no MoE knowledge.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from smalti.llm.errors import ConversionError


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor inside a smalti parameter: rows ``start:stop`` of the smalti tensor.

    ``stacked``: the Hugging Face tensor is the single index ``start`` of the smalti tensor's first dimension
    (``stop == start + 1``), e.g. one expert's weight inside a stacked expert tensor. ``cols``: it fills only
    the columns ``cols[0]:cols[1]`` of the smalti tensor's last dimension (an expert's gate or up half of a
    fused GLU weight). ``transposed``: the Hugging Face tensor holds that piece with its last two dimensions
    swapped (GPT-2's ``Conv1D`` ``[in, out]``, or experts stored ``[out, in]`` where smalti-moe keeps
    ``[in, out]``); the smalti tensor's rows stay the first dimension either way. ``merged``: the Hugging Face
    tensor holds all of rows ``start:stop`` with its first two dimensions merged into one (DBRX's experts
    ``[E * ffn, d]`` for smalti-moe's ``[E, d, ffn]`` columns, after ``cols`` and ``transposed``).
    """

    hf_name: str
    start: int
    stop: int
    transposed: bool = False
    stacked: bool = False
    cols: tuple[int, int] | None = None
    merged: bool = False

    def hf_shape(self, smalti_shape: list[int] | tuple[int, ...]) -> list[int]:
        """The shape of the Hugging Face tensor, given the whole smalti parameter's shape."""
        shape = list(smalti_shape[1:]) if self.stacked else [self.stop - self.start, *smalti_shape[1:]]
        if self.cols is not None:
            shape[-1] = self.cols[1] - self.cols[0]
        if self.transposed and len(shape) >= 2:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return [shape[0] * shape[1], *shape[2:]] if self.merged else shape

    def of(self, tensor: Any) -> Any:
        """This part of the whole smalti ``tensor``, laid out as the Hugging Face tensor."""
        piece = self.view(tensor[self.start] if self.stacked else tensor[self.start : self.stop])
        return piece.reshape(-1, *piece.shape[2:]) if self.merged else piece

    def view(self, rows: Any) -> Any:
        """``rows`` (this part's rows of the smalti tensor, or its one row when ``stacked``) seen as the Hugging
        Face tensor's layout: the ``cols`` taken and the last two dimensions swapped when ``transposed`` (a
        ``merged`` part's first two dimensions stay apart: :meth:`hf_rows` gives its rows that shape too)."""
        if self.cols is not None:
            rows = rows[..., self.cols[0] : self.cols[1]]
        return rows.transpose(-2, -1) if self.transposed and rows.dim() >= 2 else rows

    def hf_rows(self, piece: Any, start: int, stop: int, ndim: int) -> Any:
        """The rows ``start:stop`` (of the ``ndim``-dimensional smalti tensor, within this part) read from the
        Hugging Face tensor ``piece`` (a safetensors slice or a tensor), in the Hugging Face layout."""
        if self.stacked:
            return piece[:]
        a, b = start - self.start, stop - self.start
        if self.merged:  # each smalti row is `per_row` rows of the Hugging Face tensor
            shape = list(piece.get_shape() if hasattr(piece, "get_shape") else piece.shape)
            per_row = shape[0] // (self.stop - self.start)
            return piece[a * per_row : b * per_row].reshape(b - a, per_row, *shape[1:])
        return piece[:, a:b] if self.transposed and ndim == 2 else piece[a:b]


#: smalti parameter name -> the Hugging Face tensors it is made of, in file order
WeightParts = dict[str, list[Part]]


@dataclass(frozen=True)
class AdapterSite:
    """The ``transformers`` linear module a smalti LoRA part (rows ``start:stop`` of a smalti weight) maps onto,
    as PEFT names it: ``module`` (its path in the ``transformers`` model), the part's output rows ``start:stop``
    inside it, its output size ``rows`` (more than the part's when the module fuses several smalti parts, as
    DBRX's and MPT's ``Wqkv``), and ``fan_in_fan_out`` (its weight is stored ``[in, out]``: GPT-2's ``Conv1D``)."""

    module: str
    start: int
    stop: int
    rows: int
    fan_in_fan_out: bool = False


class Family:
    """Base class of a Hugging Face family module's family (one instance per ``model_type``).

    Subclasses set :attr:`model_type` and :attr:`architecture` and implement the four methods. Register one
    with :func:`smalti.llm.hf.registry.register` or, from another distribution, under the
    ``smalti.llm.hf_families`` entry-point group (the entry point names a :class:`Family` instance).
    """

    #: ``config.json``'s ``model_type``.
    model_type: ClassVar[str] = ""
    #: The ``transformers`` class its folders load as (``config.json``'s ``architectures``).
    architecture: ClassVar[str] = ""
    #: The FFN kind of its blocks: ``glu``, ``mlp`` or ``moe`` (experts mapped by ``stacked`` parts).
    ffn: ClassVar[str] = "glu"
    #: A short human description for error messages (``"Llama 1/2/3/3.1"``).
    description: ClassVar[str] = ""
    #: Why LoRA on this family's experts (``model.lora.targets`` with ``experts``) cannot give an adapter folder
    #: PEFT loads onto the ``transformers`` model; None when PEFT's ``target_parameters`` can hold it.
    expert_lora_refusal: ClassVar[str | None] = None

    def llm_kwargs(self, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
        """The family mapping: :class:`~smalti.llm.model.config.LLMConfig` fields (by name) equal to the model
        ``cfg`` (a ``config.json`` at ``path``) describes, the others left at their defaults; raises
        :class:`~smalti.llm.errors.ConversionError` naming a field it cannot reproduce. The registry's
        :func:`~smalti.llm.hf.registry.llm_config` builds the :class:`LLMConfig` from it (so an unknown name
        fails there)."""
        raise NotImplementedError

    def problems(self, config: dict[str, Any]) -> list[str]:
        """Why a smalti model with ``config`` (``LLM.config``) does not have this family's shape (empty: it has)."""
        raise NotImplementedError

    def hf_config(self, config: dict[str, Any], dtype: str, eos_token_id: int | None = None) -> dict[str, Any]:
        """The ``config.json`` of this family's model equal to a smalti model with ``config``."""
        raise NotImplementedError

    def weight_parts(self, config: dict[str, Any], names: Collection[str] | None = None) -> WeightParts:
        """For each parameter of a smalti model with ``config``, the Hugging Face tensors it is made of.

        ``names``: the tensor names a folder's files hold, when reading one (a family whose folders come in
        several layouts, such as per-expert or fused expert tensors, picks by them); None when writing, which
        uses the layout ``transformers`` itself writes."""
        raise NotImplementedError

    def adapter_site(self, parts: WeightParts, weight: str, start: int, stop: int) -> AdapterSite:
        """Where the LoRA part on rows ``start:stop`` of the smalti linear ``weight`` (``blocks.0.attn.wqkv.weight``)
        sits in this family's ``transformers`` model, read from its weight names (``parts``: :meth:`weight_parts`
        as written); raises :class:`~smalti.llm.errors.ConversionError` when no single linear module holds it."""
        for part in parts.get(weight, []):
            plain = not (part.stacked or part.merged or part.cols) and part.hf_name.endswith(".weight")
            if plain and part.start <= start and stop <= part.stop:
                return AdapterSite(part.hf_name.removesuffix(".weight"), start - part.start, stop - part.start,
                                   part.stop - part.start, part.transposed)
        raise ConversionError(f"{weight} rows {start}:{stop} are no single linear module of {self.model_type}'s "
                              "transformers model, so PEFT cannot hold an adapter on them")

    def expert_adapter_module(self, layer: int) -> str:
        """The ``transformers`` module holding layer ``layer``'s fused experts, whose ``gate_up_proj`` and
        ``down_proj`` parameters PEFT's ``target_parameters`` adapt (see :attr:`expert_lora_refusal`)."""
        if self.expert_lora_refusal is not None:
            raise ConversionError(f"LoRA on {self.model_type}'s experts cannot be written for PEFT: "
                                  f"{self.expert_lora_refusal}")
        return f"model.layers.{layer}.mlp.experts"

    def zero_tensors(self, config: dict[str, Any]) -> dict[str, list[int]]:
        """Tensors the Hugging Face class always has but this smalti model does not (written as zeros), by shape."""
        return {}

    def __repr__(self) -> str:
        return f"<hf family {self.model_type}>"
