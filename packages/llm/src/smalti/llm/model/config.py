"""Every option of :class:`~smalti.llm.LLM` in one dataclass: its type, default, constraint and meaning.

Adding an option means adding a field here (and, when Hugging Face models have it, to the family mapping under
:mod:`smalti.llm.hf.families`): :class:`~smalti.llm.LLM` takes an :class:`LLMConfig` (or the same names as
keywords), :class:`~smalti.llm.config_schema.LLMSchema` is derived from the fields, and a model's
``config`` is the resolved :class:`LLMConfig`, whose :meth:`LLMConfig.architecture` is what exported folders
store. Field types carry the per-value constraints the config check applies; :meth:`LLMConfig.problems` holds
the rules between fields, which both the model and the config check enforce.

This module imports neither torch nor the model, so config checks can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from smalti.core.config.types import PositiveFloat, PositiveInt
from smalti.llm.choices import ACTIVATIONS, FFN_TYPES, NORM_TYPES, POSITIONS
from smalti.llm.errors import ModelConfigError

#: Field metadata of options that say how the model is built or run, not what it computes: an exported folder
#: does not store them, and a copy of the weights (:func:`smalti.llm.model.copies.plain_copy`) does not take them.
NOT_STORED = {"stored": False}


@dataclass(kw_only=True)
class LLMConfig(Mapping[str, Any]):
    """The options of a decoder-only :class:`~smalti.llm.LLM` (as torchtitan's ``ModelArgs``).

    Read-only mapping access (``config["d_model"]``, ``config.get("moe")``) is kept for code written against
    the dict the model used to hold. Rules between fields are checked on construction
    (:class:`~smalti.llm.errors.ModelConfigError` naming the key); the per-value constraints in the field
    types are checked by the config schema before a run builds anything.
    """

    d_model: PositiveInt = 128
    """Width of the residual stream."""
    n_heads: PositiveInt = 4
    """Query heads."""
    n_layers: PositiveInt = 2
    """Transformer blocks."""
    vocab_size: PositiveInt = 2048
    """Rows of the embedding and of the output head."""
    max_seq_len: PositiveInt = 256
    """Longest sequence a batch may have (and the size of a learned position table)."""
    n_kv_heads: PositiveInt | None = None
    """Key/value heads (grouped-query attention); default ``n_heads``, 1 is multi-query."""
    expansion_ratio: PositiveFloat = field(default=4, metadata=NOT_STORED)
    """FFN width as a multiple of ``d_model``, when ``ffn_hidden_size`` is not given."""
    ffn_hidden_size: PositiveInt | None = None
    """FFN width; wins over ``expansion_ratio``."""
    position: Literal[POSITIONS] = "rope"  # type: ignore[valid-type]
    """Positions: ``alibi``, ``rope``, ``learned`` (a table) or ``none``."""
    rope_theta: PositiveFloat = 10000.0
    """The RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE frequency scaling for long contexts: ``{type: linear|llama3, factor, ...}``."""
    alibi_bias_max: PositiveFloat = 8.0
    """ALiBi's largest slope exponent, as in MPT."""
    qk_norm: bool = False
    """Normalise queries and keys (see ``qk_norm_scope``)."""
    clip_qkv: PositiveFloat | None = None
    """Clamp the query/key/value projections to ``[-clip_qkv, clip_qkv]`` (MPT's)."""
    softmax_scale: PositiveFloat | None = None
    """The attention logits' scale; default ``1 / sqrt(head size)``."""
    bias: bool = False
    """Biases in every linear layer and norm (MPT's ``no_bias: true`` is ``bias: false``)."""
    attn_bias: bool | None = None
    """Biases on the attention projections only, overriding ``bias`` there (Hugging Face's ``attention_bias``)."""
    ffn_bias: bool | None = None
    """Biases on the FFN projections only, overriding ``bias`` there (Hugging Face's ``mlp_bias``)."""
    qkv_bias: bool | None = None
    """A bias on the query/key/value projection only (Qwen2's), overriding ``attn_bias`` there."""
    sliding_window: PositiveInt | None = None
    """Each position attends to itself and the ``sliding_window - 1`` before it (Mistral's); default the whole
    causal prefix."""
    norm_type: Literal[NORM_TYPES] = "layernorm"  # type: ignore[valid-type]
    """``layernorm``, ``rmsnorm``, ``low_precision_layernorm``, ``low_precision_rmsnorm`` or ``rmsnorm_plus_one``."""
    norm_eps: PositiveFloat = 1e-5
    """The norms' epsilon."""
    ffn_type: Literal[FFN_TYPES] = "mlp"  # type: ignore[valid-type]
    """``mlp``, ``glu`` or ``moe`` (with ``moe``)."""
    activation: Literal[ACTIVATIONS] | None = None  # type: ignore[valid-type]
    """``gelu``, ``gelu_tanh``, ``silu`` or ``relu``; default ``silu`` for ``glu``, else ``gelu``."""
    moe: dict[str, Any] | None = None
    """The mixture of experts of ``ffn_type: moe``: ``{num_experts, top_k, loss_weight, ...}`` (smalti-moe's)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    attn_uses_sequence_id: bool = True
    """Mask attention across packed documents when the batch has ``sequence_id``."""
    activation_checkpointing: Any = field(default=None, metadata=NOT_STORED)
    """What blocks recompute in backward: null, true, a granularity or ``{granularity, layers}``."""
    activation_compression: Any = field(default=None, metadata=NOT_STORED)
    """Store the activations kept for backward as ``bf16`` or ``fp8``, or ``{format, granularity, layers}``
    (:mod:`smalti.core.activation_compression`); a checkpointed part keeps only its input, uncompressed."""
    init_device: str | None = field(default=None, metadata=NOT_STORED)
    """``cpu``, ``cuda`` or ``meta`` (no memory; call ``init_weights`` after ``to_empty``)."""
    init_std: PositiveFloat = 0.02
    """Std of the normal init; residual output projections get ``init_std / sqrt(2 n_layers)``."""
    fused_loss: bool = field(default=True, metadata=NOT_STORED)
    """In training, compute the output projection and the cross-entropy together in chunks of rows
    (:mod:`smalti.llm.model.fused_loss`), so the ``[B, T, vocab]`` logits are never held."""
    sparse_embedding_grad: bool = field(default=True, metadata=NOT_STORED)
    """Give the token embedding a row-sparse gradient (only the rows of the batch's tokens,
    ``F.embedding(sparse=True)``) instead of a dense one the size of the table, where the step can take it: an
    untied embedding that trains, in smalti-core's trainer, in a single-process run without ``torch.compile`` (a
    sharded or replicated embedding, and a plain ``optimizer.step()`` loop, keep the dense gradient). The trainer sums, clips and steps it
    (:mod:`smalti.core.optim.row_sparse`); the update equals the dense one."""
    head_dim: PositiveInt | None = None
    """The size of each attention head; default ``d_model // n_heads`` (Qwen3 and Gemma differ)."""
    lora: dict[str, Any] | None = field(default=None, metadata=NOT_STORED)
    """LoRA/QLoRA adapters on the block linear layers with the base frozen (r, alpha, dropout, targets,
    modules_to_save, rslora, base_dtype, init_from; see :mod:`smalti.llm.lora`)."""
    embed_scale: PositiveFloat | None = None
    """Multiply the input embeddings by this (Gemma: ``sqrt(d_model)``)."""
    post_norms: bool = False
    """Also normalise each block's attention and FFN output before the residual add (Gemma)."""
    window_layers: list[bool] | None = None
    """Per layer, whether ``sliding_window`` applies to it (Gemma's local/global alternation); default all."""
    rope_local_theta: PositiveFloat | None = None
    """The RoPE base of the windowed layers when it differs from ``rope_theta`` (Gemma 3)."""
    qk_norm_scope: Literal["head", "all"] = "head"
    """What ``qk_norm`` normalises: each ``head`` (Qwen3) or ``all`` of the query and of the key projection at
    once (OLMo, OLMoE)."""

    def __post_init__(self) -> None:
        for key, value, expected in self.problems():
            raise ModelConfigError(f"model.{key}={value!r}: expected {expected}")

    # ------------------------------------------------------------------ building and resolving

    @classmethod
    def of(cls, config: Mapping[str, Any] | None = None, /, **options: Any) -> LLMConfig:
        """An :class:`LLMConfig` from another one or a mapping of its field names (an exported folder's stored
        options, a Hydra node), with ``options`` replacing some; an unknown name is an error naming it."""
        merged = {**(dict(config.items()) if config is not None else {}), **options}
        names = field_names()
        for key in merged:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {near[0]}?" if near else f"; the options are {', '.join(names)}"
                raise ModelConfigError(f"model.{key} is not an option of smalti.llm.LLM{hint}")
        return cls(**merged)

    def resolved(self) -> LLMConfig:
        """This config with every derived default filled in (what a built model holds as ``config``): the
        key/value heads, the FFN width, each bias and the activation; nested options as plain containers."""
        n_kv_heads = self.n_kv_heads or self.n_heads
        attn_bias = self.bias if self.attn_bias is None else bool(self.attn_bias)
        return dataclasses.replace(
            self,
            n_kv_heads=n_kv_heads,
            ffn_hidden_size=int(self.ffn_hidden_size) if self.ffn_hidden_size else int(self.expansion_ratio * self.d_model),
            attn_bias=attn_bias,
            ffn_bias=self.bias if self.ffn_bias is None else bool(self.ffn_bias),
            qkv_bias=attn_bias if self.qkv_bias is None else bool(self.qkv_bias),
            activation=self.activation or ("silu" if self.ffn_type == "glu" else "gelu"),
            rope_scaling=_plain(self.rope_scaling) if self.rope_scaling else None,
            moe=_plain(self.moe) if self.moe else None,
            window_layers=[bool(w) for w in self.window_layers] if self.window_layers is not None else None,
        )

    def architecture(self) -> dict[str, Any]:
        """The options that decide what the model computes, as plain JSON-ready values: what an exported folder
        stores (``smalti_llm.json``) and what a copy of the weights is built from (not the ``NOT_STORED`` ones).
        Resolve first (:meth:`resolved`) so that the FFN width is stored rather than its ratio."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata.get("stored", True)}

    # ------------------------------------------------------------------ rules between fields

    def problems(self) -> list[tuple[str, Any, str]]:
        """Broken rules between this config's fields (see :func:`option_problems`); empty when they agree."""
        return option_problems(self)

    # ------------------------------------------------------------------ read-only mapping access

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELD_SET:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(field_names())

    def __len__(self) -> int:
        return len(_FIELD_SET)


def field_names() -> tuple[str, ...]:
    """Every option of :class:`LLMConfig`, in declaration order."""
    return _FIELD_NAMES


def options_signature() -> inspect.Signature:
    """``(self, config=None, /, *, d_model=128, ...)``: the signature :class:`~smalti.llm.LLM`'s ``__init__``
    shows to ``help``, ``inspect`` and config tools, with every option's default (it takes them as
    ``**options``)."""
    hints = typing.get_type_hints(LLMConfig, include_extras=True)
    kw = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("config", inspect.Parameter.POSITIONAL_ONLY, default=None, annotation=LLMConfig | None),
        *(inspect.Parameter(f.name, kw, default=f.default, annotation=hints[f.name])
          for f in dataclasses.fields(LLMConfig)),
    ], return_annotation=None)


def option_problems(o: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """Broken rules between the options ``o`` (every :class:`LLMConfig` field by name), as ``(key, value, what
    was expected)``: the one list of them, which the model and the config schema both apply. Values of the
    wrong type are left to the schema's per-field checks (a rule needing them is skipped)."""
    out: list[tuple[str, Any, str]] = []
    d, heads, kv, head_dim = o["d_model"], o["n_heads"], o["n_kv_heads"], o["head_dim"]
    if not all(_positive_int(v) for v in (d, heads, kv or heads)):
        return out
    if d % heads:
        out.append(("n_heads", heads, f"a divisor of model.d_model={d}"))
    if kv is not None and heads % kv:
        out.append(("n_kv_heads", kv, f"a divisor of model.n_heads={heads}"))
    if o["position"] not in POSITIONS:
        out.append(("position", o["position"], f"one of {', '.join(POSITIONS)}"))
    if head_dim is not None and not _positive_int(head_dim):
        out.append(("head_dim", head_dim, "a positive int or null (d_model/n_heads)"))
    elif o["position"] == "rope" and (head_dim or d // heads) % 2:
        key = "head_dim" if head_dim else "n_heads"
        out.append((key, o[key], f"an even head size for position=rope (now {head_dim or d // heads})"))
    if o["sliding_window"] is not None and not _positive_int(o["sliding_window"]):
        out.append(("sliding_window", o["sliding_window"], "a positive int or null"))
    window_layers = o["window_layers"]
    if window_layers is not None and len(window_layers) != o["n_layers"]:
        out.append(("window_layers", window_layers, f"one entry per layer (n_layers={o['n_layers']})"))
    return out


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _plain(value: Any) -> Any:
    """``value`` with mappings as dicts and sequences as lists, all the way down (OmegaConf nodes included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LLMConfig))
_FIELD_SET = frozenset(_FIELD_NAMES)
