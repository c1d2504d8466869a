"""The decoder-only transformer (MPT and Llama families) following smalti's model protocol.

Batches are dicts: ``input_ids [B, T]``; optional ``labels [B, T]`` (default: ``input_ids``; ``-100`` is
ignored), ``sequence_id [B, T]`` (packed documents do not attend to each other) and ``attention_mask``
(right padding; only used to count tokens). Position ``t`` predicts label ``t + 1``.

Under sequence parallelism (:meth:`LLM.enable_sequence_parallel`) every rank of the ``sp`` group gets the
same whole batch and computes the positions of its own chunk; see
:mod:`smalti.llm.model.sequence_parallel`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from smalti.core.activation_compression import ActivationCompression
from smalti.core.cpu_gemm import Linear, linear
from smalti.core.optim.row_sparse import note_sparse_grad, sparse_grads_accepted
from smalti.llm.errors import ModelConfigError
from smalti.llm.model.attention import Attention
from smalti.llm.model.attention_mask import AttentionMask
from smalti.llm.model.checkpointing import parse_activation_checkpointing, parse_activation_compression
from smalti.llm.model.config import LLMConfig, options_signature
from smalti.llm.model.ffn import MoEFFN, make_ffn
from smalti.llm.model.fused_loss import fused_linear_cross_entropy
from smalti.llm.model.norms import make_norm
from smalti.llm.model.position import Rotary, alibi_slopes
from smalti.llm.model.sequence_parallel import SequenceParallelGroup

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


class LMOutputs(dict):
    """A training forward's outputs under the fused loss: ``hidden`` (after the final norm) and
    ``output_weight``; ``outputs["logits"]`` projects them on first access (for code that wants logits)."""

    def __missing__(self, key: str) -> Any:
        if key != "logits":
            raise KeyError(key)
        logits = _project(self["hidden"], self["output_weight"])
        self["logits"] = logits
        return logits


def _project(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``hidden @ weight.T``; a head held in lower precision than the run (a LoRA model's frozen bf16
    head outside autocast) is used in the hidden states' dtype."""
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        weight = weight.to(hidden.dtype)
    return linear(hidden, weight)  # fp32 CPU: through smalti.core.cpu_gemm's backend


#: ``torch.compile(Block._forward, **kwargs)`` per set of kwargs, shared by every block that compiles.
_COMPILED_FORWARDS: dict[tuple, Any] = {}


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm_1(x))`` then ``x + ffn(norm_2(x))``; returns ``(x, aux_loss)``.

    With ``post_attn_norm`` / ``post_ffn_norm`` (Gemma's "sandwich" norms) each branch's output is normalised
    before it is added back; ``windowed`` says whether the block takes the sliding-window mask.
    """

    def __init__(self, attn: Attention, ffn: nn.Module, norm_1: nn.Module, norm_2: nn.Module,
                 post_attn_norm: nn.Module | None = None, post_ffn_norm: nn.Module | None = None,
                 windowed: bool = True) -> None:
        super().__init__()
        self.norm_1 = norm_1
        self.attn = attn
        self.norm_2 = norm_2
        self.ffn = ffn
        self.post_attn_norm = post_attn_norm
        self.post_ffn_norm = post_ffn_norm
        self.windowed = windowed
        self.checkpointing: str | None = None  # "block", "attention" or "ffn"
        #: what this block's saved activations are stored as, and around which part ("block", "attention", "ffn")
        self.compression: ActivationCompression | None = None
        self.compression_scope: str | None = None
        self._compiled: Any = None  # a torch.compile of Block._forward, set by compile_forward

    def compile_forward(self, **kwargs: Any) -> None:
        """Run this block's computation through ``torch.compile(**kwargs)`` (``LLM.compile`` calls it).

        The module call stays eager, so hooks on the block (FSDP2's gathers, activation checkpointing) wrap the
        compiled code instead of being traced by it; every block shares one compiled graph (same code, same
        shapes; the parameters are inputs of the graph).
        """
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in _COMPILED_FORWARDS:  # one function for all blocks (no bound method kept on the module)
            _COMPILED_FORWARDS[key] = torch.compile(Block._forward, **kwargs)
        self._compiled = _COMPILED_FORWARDS[key]

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, sp: SequenceParallelGroup | None = None,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x, aux)``; ``token_weights [B, T]`` (padding 0) reach an MoE FFN's balance statistics."""
        run = self._forward if self._compiled is None else functools.partial(self._compiled, self)
        if self.checkpointing == "block" and torch.is_grad_enabled():
            return checkpoint(run, x, mask, sp, token_weights, use_reentrant=False)
        if self.compression_scope == "block" and torch.is_grad_enabled():
            with self.compression:
                return run(x, mask, sp, token_weights)
        return run(x, mask, sp, token_weights)

    def _ffn(self, h: torch.Tensor, token_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ffn(h) if token_weights is None or not isinstance(self.ffn, MoEFFN) else self.ffn(h, token_weights)

    def _forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, sp: SequenceParallelGroup | None,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        recompute = torch.is_grad_enabled()
        h = self.norm_1(x)
        if self.checkpointing == "attention" and recompute:
            a = checkpoint(self.attn, h, mask, sp, use_reentrant=False)
        elif self.compression_scope == "attention" and recompute:
            with self.compression:
                a = self.attn(h, mask, sp)
        else:
            a = self.attn(h, mask, sp)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + a
        h = self.norm_2(x)
        if self.checkpointing == "ffn" and recompute:
            y, aux = checkpoint(self._ffn, h, token_weights, use_reentrant=False)
        elif self.compression_scope == "ffn" and recompute:
            with self.compression:
                y, aux = self._ffn(h, token_weights)
        else:
            y, aux = self._ffn(h, token_weights)
        if self.post_ffn_norm is not None:
            y = self.post_ffn_norm(y)
        return x + y, aux


class LLM(nn.Module):
    """A decoder-only causal language model.

    Built from an :class:`~smalti.llm.model.config.LLMConfig` (every option's type, default and meaning is
    documented there), from its fields as keywords (Hydra's ``_target_: smalti.llm.LLM``), or both: keywords
    replace the config's values (``LLM(config, init_device="meta")``). :attr:`config` is the resolved
    :class:`LLMConfig` (derived defaults filled in); ``config.architecture()`` is what exports store.
    """

    def __init__(self, config: LLMConfig | None = None, /, **options: Any) -> None:
        super().__init__()
        #: Every option, with the derived defaults (key/value heads, FFN width, biases, activation) filled in.
        self.config: LLMConfig = LLMConfig.of(config, **options).resolved()
        c = self.config
        d_model, n_heads, n_layers = c.d_model, c.n_heads, c.n_layers
        # Every block's FFN is an MoE: each layer scales its balancing loss by the layer count, so that their
        # sum is MegaBlocks' batched loss rather than n_layers times it.
        layer_moe = {"num_layers": n_layers, **c.moe} if c.ffn_type == "moe" and c.moe else c.moe
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.vocab_size, self.max_seq_len = c.vocab_size, c.max_seq_len
        self.position = c.position
        self.attn_uses_sequence_id = c.attn_uses_sequence_id
        self.sliding_window = c.sliding_window
        self.init_std = c.init_std
        self.fused_loss = bool(c.fused_loss)
        self.sparse_embedding_grad = bool(c.sparse_embedding_grad)
        self.embed_scale = c.embed_scale
        # the full-attention mask is built too only when some layers are not windowed
        self._mixed_windows = c.sliding_window is not None and c.window_layers is not None and not all(c.window_layers)
        device = torch.device(c.init_device) if c.init_device else None
        head_dim = c.head_dim or d_model // n_heads
        rotary = Rotary(head_dim, c.rope_theta, c.rope_scaling) if c.position == "rope" else None
        local_rotary = rotary
        if rotary is not None and c.rope_local_theta is not None:
            local_rotary = Rotary(head_dim, c.rope_local_theta, None)
        windowed = [True] * n_layers if c.window_layers is None else c.window_layers
        self._alibi_slopes = alibi_slopes(n_heads, c.alibi_bias_max) if c.position == "alibi" else None

        def norm() -> nn.Module:
            return make_norm(c.norm_type, d_model, c.norm_eps, c.bias)

        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.wte = nn.Embedding(c.vocab_size, d_model)
            self.wpe = nn.Embedding(c.max_seq_len, d_model) if c.position == "learned" else None
            self.blocks = nn.ModuleList(
                Block(
                    Attention(d_model, n_heads, c.n_kv_heads, c.attn_bias, c.qk_norm, c.norm_type, c.norm_eps,
                              local_rotary if windowed[i] else rotary, c.softmax_scale,
                              c.clip_qkv, qkv_bias=c.qkv_bias, head_dim=c.head_dim, qk_norm_scope=c.qk_norm_scope),
                    make_ffn(c.ffn_type, d_model, c.ffn_hidden_size, c.activation, c.ffn_bias, layer_moe),
                    norm(),
                    norm(),
                    norm() if c.post_norms else None,
                    norm() if c.post_norms else None,
                    windowed=windowed[i],
                )
                for i in range(n_layers)
            )
            self.norm_f = norm()
            self.lm_head = None if c.tie_embeddings else Linear(d_model, c.vocab_size, bias=False)
        self.set_activation_checkpointing(c.activation_checkpointing)
        self.set_activation_compression(c.activation_compression)
        self.sp: SequenceParallelGroup | None = None
        self.n_params = sum(p.numel() for p in self.parameters())
        self.n_active_params = self._active_params()
        #: The ``model.lora`` settings once adapters are applied (:mod:`smalti.llm.lora`), else None.
        self.lora_config: Any = None
        if c.lora:
            from smalti.llm.lora.apply import apply_lora

            apply_lora(self, c.lora)
        if device is None or device.type != "meta":
            self.init_weights()

    __init__.__signature__ = options_signature()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ construction helpers

    def set_activation_checkpointing(self, spec: Any) -> None:
        """Choose what each block recomputes in backward (see :mod:`smalti.llm.model.checkpointing`)."""
        chosen = parse_activation_checkpointing(spec, self.n_layers)
        for i, block in enumerate(self.blocks):
            block.checkpointing = chosen.get(i)

    def set_activation_compression(self, spec: Any) -> None:
        """Choose how each block stores the activations it keeps for backward (``activation_compression``)."""
        chosen = parse_activation_compression(spec, self.n_layers)
        for i, block in enumerate(self.blocks):
            fmt, scope = chosen.get(i, (None, None))
            block.compression = ActivationCompression(fmt) if fmt else None
            block.compression_scope = scope

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """``torch.compile`` each transformer block (what ``Trainer(compile=True)`` / ``trainer.compile=true``
        calls), rather than the whole forward: the blocks are where Inductor pays (the norms, RoPE, the gated
        activation and the residual adds fused around the matrix products), while the embedding, the mask and
        the chunked fused loss stay eager (matrix products and data-dependent loops it would not speed up).
        Keyword arguments go to ``torch.compile``; compiling happens at each block's first call."""
        if args:
            raise TypeError("LLM.compile takes torch.compile's keyword arguments only")
        for block in self.blocks:
            block.compile_forward(**kwargs)

    def _active_params(self) -> int:
        """Parameters used per token: all but the position table and the experts a token is not routed to."""
        total = self.n_params - (self.wpe.weight.numel() if self.wpe is not None else 0)
        moe = self.config.moe
        if self.config.ffn_type != "moe" or not moe:
            return total
        experts = moe.get("num_experts", moe.get("moe_num_experts", 1))
        top_k = moe.get("top_k", moe.get("moe_top_k", 1))
        expert_params = sum(
            p.numel()
            for module in self.modules()
            if callable(getattr(module, "expert_parameters", None))
            for p in module.expert_parameters()
        )
        return int(total - expert_params * (1 - top_k / max(experts, 1)))

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every weight: normal(0, init_std), residual projections scaled by 1/sqrt(2 n_layers); norms
        to ones (and zero bias), buffers to zero. The same whether the model was built on a device or on meta."""
        residual_std = self.init_std / math.sqrt(2 * self.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = residual_std if getattr(module, "_is_residual", False) else self.init_std
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, self.init_std)
            elif module is not self and hasattr(module, "reset_parameters") and (
                not list(module.children()) or list(module.parameters(recurse=False))
            ):
                # Leaf modules (norms), and modules holding parameters of their own such as an MoE's experts.
                module.reset_parameters()
        # Every buffer of this model starts at zero (MoE token counters, router biases); after ``to_empty`` on a
        # meta-built model they hold whatever the allocator left there.
        for buf in self.buffers():
            buf.zero_()
        self.finish_adapters()

    @property
    def checkpoint_trainable_only(self) -> bool:
        """A LoRA model's checkpoints hold the adapters only (the frozen base is read from its files at start)."""
        return self.lora_config is not None

    def finish_adapters(self) -> None:
        """Start the LoRA adapters once the base weights are in (see :func:`smalti.llm.lora.finish_lora_init`);
        every ``init_weights`` calls it last."""
        if self.lora_config is not None:
            from smalti.llm.lora.apply import finish_lora_init

            finish_lora_init(self)

    def enable_sequence_parallel(self, group: Any) -> None:
        """Split every sequence over the ranks of ``group`` (Ulysses), or switch it off with ``None``.

        Every rank of ``group`` must be given the same batches (the ``sp`` parallelism and the streaming
        dataset's ``replication`` see to that). ``n_heads`` must divide by the group size; key/value heads
        that do not are copied per query head. Only training forwards are split: in eval mode (evaluation,
        ICL, generation) and for sequence lengths that do not divide by the group size, every rank runs the
        whole sequence.
        """
        if group is None:
            self.sp = None
            return
        sp = group if isinstance(group, SequenceParallelGroup) else SequenceParallelGroup.from_group(group)
        if self.n_heads % sp.size:
            raise ModelConfigError(
                f"model.n_heads={self.n_heads} does not divide over parallelism.sp={sp.size} sequence-parallel "
                "ranks; choose an sp that divides the head count"
            )
        self.sp = sp if sp.size > 1 else None

    def _active_sp(self, seq_len: int) -> SequenceParallelGroup | None:
        sp = self.sp
        if sp is None or not self.training:
            return None  # evaluation, ICL and generation want every position's logits on every rank
        if seq_len % sp.size:
            log.debug("sequence length %d does not divide over %d sp ranks: running it whole", seq_len, sp.size)
            return None
        return sp

    def fsdp_blocks(self) -> list[nn.Module]:
        """The units FSDP2 shards one by one: the transformer blocks."""
        return list(self.blocks)

    @property
    def output_weight(self) -> torch.Tensor:
        """The weight of the output projection (the embedding when tied)."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    # ------------------------------------------------------------------ forward and loss

    def _mask(
        self, batch: dict[str, torch.Tensor], seq_len: int, device: torch.device, sp: SequenceParallelGroup | None,
        windowed: bool = True,
    ) -> AttentionMask | None:
        sequence_id = batch.get("sequence_id") if self.attn_uses_sequence_id else None
        slopes = self._alibi_slopes
        if slopes is not None and sp is not None:
            start, stop = sp.heads(self.n_heads)
            slopes = slopes[start:stop]
        return AttentionMask.build(seq_len, sequence_id, slopes, self.sliding_window if windowed else None)

    def _embedding_grad_is_sparse(self) -> bool:
        """Whether this forward gives the token embedding a row-sparse gradient (see ``sparse_embedding_grad``):
        only inside smalti-core's trainer step, which takes such gradients (a plain loop's ``optimizer.step()``
        would refuse them); a tied weight gets the head's dense gradient anyway, a DTensor (FSDP2, TP) cannot hold a sparse one,
        DDP would all-reduce it densely, and ``torch.compile`` traces the dense lookup."""
        if not isinstance(self.wte, nn.Embedding):
            return False
        weight = self.wte.weight
        return (self.sparse_embedding_grad and sparse_grads_accepted() and self.training and weight.requires_grad and torch.is_grad_enabled()
                and self.lm_head is not None and type(weight) is nn.Parameter
                and not torch.compiler.is_compiling()
                and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Logits ``[B, T, vocab]`` under ``"logits"``, plus ``"aux_loss"`` (summed over layers) for MoE FFNs.

        With ``fused_loss`` on, a training forward (grad enabled) returns :class:`LMOutputs` instead: the
        cross-entropy of the batch's own targets, computed chunk by chunk here inside forward (where FSDP2 has
        the output weight gathered), for :meth:`loss`; the final hidden states ``"hidden"`` and the weight for
        other targets; and ``"logits"``, computed on first access only.

        Under sequence parallelism the logits are this rank's chunk ``[B, T/sp, vocab]`` and
        ``"sequence_slice"`` holds ``(start, stop, sp)`` for :meth:`loss` and the metrics.
        """
        ids = batch["input_ids"]
        seq_len = ids.shape[1]
        if seq_len > self.max_seq_len:
            raise ModelConfigError(
                f"batch sequence length {seq_len} exceeds model.max_seq_len={self.max_seq_len}; raise max_seq_len "
                "or shorten the data's max_seq_len"
            )
        sp = self._active_sp(seq_len)
        start, stop = sp.chunk(seq_len) if sp is not None else (0, seq_len)
        if isinstance(self.wte, nn.Embedding):
            self.wte.sparse = self._embedding_grad_is_sparse()
            if self.wte.sparse:
                note_sparse_grad(self.wte.weight)
        x = self.wte(ids[:, start:stop])
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, stop, device=ids.device))
        mask = self._mask(batch, seq_len, ids.device, sp)
        full = self._mask(batch, seq_len, ids.device, sp, windowed=False) if self._mixed_windows else mask
        aux_losses = []
        padding = batch.get("attention_mask")  # left out of the MoE balance statistics, as in transformers
        padding = padding[:, start:stop] if padding is not None else None
        for block in self.blocks:
            x, aux = block(x, mask if block.windowed else full, sp, padding)
            if aux is not None:
                aux_losses.append(aux)
        x = self.norm_f(x)
        out: dict[str, Any]
        if self.fused_loss and self.training and torch.is_grad_enabled():
            out = LMOutputs(hidden=x, output_weight=self.output_weight)
            if sp is not None:
                out["sequence_slice"] = (start, stop, sp.size)
            targets = self._local_targets(out, batch)
            out["fused_labels"] = batch.get("labels", batch["input_ids"])  # what the targets were made from
            out["fused_ce"] = self._fused_ce(x, self.output_weight, targets, sp is not None)
        else:
            out = {"logits": _project(x, self.output_weight)}
        if sp is not None:
            out["sequence_slice"] = (start, stop, sp.size)
        if aux_losses:
            out["aux_loss"] = self._aux_loss(aux_losses)
        return out

    def _aux_loss(self, per_block: list[torch.Tensor]) -> torch.Tensor:
        """The model's auxiliary loss from its blocks': their sum, or, for MoE layers that pool their balance
        statistics over the model (``moe.lbl_scope: model``, Hugging Face's families), the pooled loss."""
        pooled = [a for a in per_block if a.dim() > 0]
        total = torch.stack([a.float() for a in per_block if a.dim() == 0] or [per_block[0].new_zeros(())]).sum()
        if pooled:
            from smalti.moe.losses import pooled_load_balancing_loss

            moe = self.config.moe or {}
            total = total + pooled_load_balancing_loss(torch.stack(pooled).sum(0), moe["num_experts"],
                                                       moe["lbl_weight"])
        return total

    @staticmethod
    def _fused_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, summed: bool) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX, "sum" if summed else "mean")

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labels each position predicts: ``labels`` shifted left by one, ``-100`` at the end."""
        labels = batch.get("labels", batch["input_ids"])
        return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)

    def _local_targets(self, outputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The targets of the positions ``outputs`` holds logits for (this rank's chunk under sp)."""
        targets = self.targets(batch)
        piece = outputs.get("sequence_slice")
        return targets[:, piece[0] : piece[1]] if piece is not None else targets

    def loss(self, outputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy over target tokens, plus the MoE auxiliary loss when present.

        Under sequence parallelism each rank returns ``sp * (its chunk's summed cross-entropy) / (target
        tokens of the whole batch)``: averaged over the ``sp`` ranks (as the loss and the gradients are, by
        data parallelism over every rank) that is the whole sequences' mean.
        """
        piece = outputs.get("sequence_slice")
        if "fused_ce" in outputs and "logits" not in outputs:
            targets = self._local_targets(outputs, batch)
            # The same labels tensor as forward's: an identity check, as comparing values would wait for the device.
            if batch.get("labels", batch["input_ids"]) is outputs["fused_labels"]:
                loss = outputs["fused_ce"]  # forward scored the same targets
            else:  # other labels than forward's batch (outside FSDP2, which frees the weight after forward)
                loss = self._fused_ce(outputs["hidden"], outputs["output_weight"], targets, piece is not None)
            if piece is not None:
                loss = loss * piece[2] / (self.targets(batch) != IGNORE_INDEX).sum().clamp(min=1)
            return loss + outputs["aux_loss"] if "aux_loss" in outputs else loss
        logits = outputs["logits"]
        if piece is None:
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), self.targets(batch).reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        else:
            count = (self.targets(batch) != IGNORE_INDEX).sum().clamp(min=1)
            local = self._local_targets(outputs, batch)
            total = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), local.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            loss = total * piece[2] / count
        if "aux_loss" in outputs:
            loss = loss + outputs["aux_loss"]
        return loss

    # ------------------------------------------------------------------ metrics and accounting

    def metrics(self, train: bool = False) -> dict[str, Any]:
        """Cross-entropy, perplexity and token accuracy."""
        # Imported here: torchmetrics imports transformers when it is installed (~270 MB of RSS), which a training
        # run without evaluation never needs.
        from smalti.llm.model.metrics import LanguageCrossEntropy, LanguagePerplexity, TokenAccuracy

        return {
            "LanguageCrossEntropy": LanguageCrossEntropy(),
            "LanguagePerplexity": LanguagePerplexity(),
            "TokenAccuracy": TokenAccuracy(),
        }

    def update_metric(self, batch: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], metric: Any) -> None:
        """Update one metric from a batch and the model's outputs, weighted by the number of target tokens."""
        targets = self._local_targets(outputs, batch)
        valid = targets != IGNORE_INDEX
        count = int(valid.sum())
        if count == 0:
            return
        logits = outputs["logits"]
        from smalti.llm.model.metrics import TokenAccuracy

        if isinstance(metric, TokenAccuracy):
            hits = (logits.argmax(-1) == targets) & valid
            metric.update(hits.sum().float() / count, weight=count)
        else:
            ce = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
            )
            metric.update(ce, weight=count)

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens this rank trains on, not counting right padding (its chunk's under sequence parallelism, so
        that the sum over all ranks counts each token once)."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        sp = self._active_sp(ids.shape[1])
        if sp is not None:
            start, stop = sp.chunk(ids.shape[1])
            return int(mask[:, start:stop].sum()) if mask is not None else int(ids[:, start:stop].numel())
        return int(mask.sum()) if mask is not None else int(ids.numel())

    def flops_per_batch(self, batch: dict[str, torch.Tensor]) -> float:
        """Training FLOPs of one batch by LLM Foundry's formula (forward + backward = 3x forward)::

            3 * (2 * n_active_params * T + n_layers * 4 * d_model * T^2) * B

        Under sequence parallelism each rank does ``1 / sp`` of that.
        """
        bs, seq_len = batch["input_ids"].shape[:2]
        params_flops = 2 * self.n_active_params * seq_len
        attn_flops = self.n_layers * 2 * 2 * self.d_model * seq_len**2
        sp = self._active_sp(seq_len)
        return float(3 * (params_flops + attn_flops) * bs) / (sp.size if sp is not None else 1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding (no KV cache: meant for evaluation of small models); returns only the new tokens.

        Always runs ``max_new_tokens`` forward passes so that every rank of a sharded model stays in step.
        """
        ids = input_ids
        new = []
        for _ in range(max_new_tokens):
            window = ids[:, -self.max_seq_len :]
            logits = self({"input_ids": window})["logits"][:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            new.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
        return torch.cat(new, dim=1) if new else input_ids[:, :0]
