"""What one micro batch of :class:`smalti.llm.LLM` costs a GPU: activation bytes and training FLOPs.

smalti-llm's answer to core's ``smalti_plan_model`` hook (``smalti plan``, :mod:`smalti.core.plan`). The
activation model follows what this package's code keeps for backward, tensor by tensor, per token:

* a block without checkpointing keeps each norm's input (LayerNorm under autocast: an fp32 copy; RMSNorm:
  the fp32 input and the normalised output), every linear layer's input in the compute dtype (autocast
  casts it once per layer), the fused ``wqkv`` output (kept whole because ``v`` is a view of it), the
  rotated ``q``/``k`` (RoPE), the attention output and its fp32 log-sum-exp (flash/efficient SDPA never
  holds ``T x T`` scores), and the FFN's hidden tensors (MLP: two of width ``ffn_hidden_size``; GLU: four);
* ``activation_checkpointing`` keeps only a checkpointed region's input (block: the block input; attention
  or ffn: the norm output fed to it) and recomputes one region at a time in backward (counted once);
* the head: with ``fused_loss`` the final hidden states, their gradient and the fp32 weight gradient, plus
  one chunk of fp32 logits (:data:`smalti.llm.model.fused_loss.CHUNK_ELEMENTS`); without it the
  ``[B, T, vocab]`` logits in the compute dtype, their fp32 log-softmax, and the two fp32 gradients of
  backward (``(c + 12)`` bytes per logit);
* masked attention (ALiBi, sliding windows, ``sequence_id``) runs in tiles: one shared bias tensor and one
  more copy of the attention output per block (:mod:`smalti.llm.model.attention_mask`).

MoE FFNs count what smalti-moe's dropless layer keeps (router scores, each chosen expert's hidden rows and
output rows; under expert parallelism the rows that arrive and return by all-to-all too), with the tokens
assumed spread evenly over the experts.
"""

from __future__ import annotations

from typing import Any

import torch

from smalti.llm.model.fused_loss import CHUNK_ELEMENTS

#: LLM Foundry's published throughput (scripts/train/benchmarking/README.md, as recorded in the project's
#: reference notes /work/shared/reference/llm-anchors.md section 7): model -> gpu -> (GPUs, MFU %, tokens/s/GPU),
#: BF16, sequence length 2048.
FOUNDRY_PUBLISHED: dict[str, dict[str, tuple[int, float, int]]] = {
    "mpt_125m": {"a100": (8, 44.79, 142_830)},
    "mpt_350m": {"a100": (8, 51.62, 58_782)},
    "mpt_760m": {"a100": (8, 56.85, 32_434), "h100": (8, 34.90, 63_147)},
    "mpt_1b": {"a100": (8, 59.86, 20_513), "h100": (8, 41.82, 45_455)},
    "mpt_3b": {"a100": (8, 62.11, 10_811), "h100": (16, 43.73, 24_142)},
    "mpt_7b": {"a100": (8, 64.23, 4_641), "h100": (8, 46.44, 10_643)},
    "mpt_13b": {"a100": (8, 59.57, 2_262), "h100": (8, 39.79, 4_792)},
    "mpt_30b": {"a100": (8, 55.30, 916), "h100": (8, 38.11, 2_002)},
    "mpt_70b": {"a100": (64, 53.33, 410), "h100": (64, 42.57, 1_039)},
}
FOUNDRY_SOURCE = "LLM Foundry scripts/train/benchmarking/README.md (2024-04), via /work/shared/reference/llm-anchors.md §7"


def _norm_bytes(norm_type: str, residual: int, autocast: int | None) -> tuple[float, float]:
    """(bytes a norm keeps for backward, bytes of its output) per element of its input."""
    if norm_type == "layernorm":
        return (4.0, 4.0) if autocast else (float(residual), float(residual))
    if norm_type == "low_precision_layernorm":
        dt = autocast or residual
        return float(dt), float(dt)
    if norm_type == "rmsnorm":
        return 4.0 + residual, float(residual)
    dt = autocast or residual  # low_precision_rmsnorm: its input cast and x * rsqrt, both in dt
    return 2.0 * dt, float(dt)


def _moe_settings(cfg: dict[str, Any]) -> tuple[int, int, str]:
    """``(num_experts, top_k, mlp_type)`` of an MoE FFN config (MegaBlocks' ``moe_`` names accepted)."""
    moe = cfg.get("moe") or {}
    mlp_type = moe.get("mlp_type", "glu" if cfg.get("activation") == "silu" else "mlp")
    return (int(moe.get("num_experts", moe.get("moe_num_experts", 1))), int(moe.get("top_k", moe.get("moe_top_k", 1))),
            mlp_type)


def _ffn_per_token(cfg: dict[str, Any], compute: int, autocast: int | None, ep: int = 1) -> float:
    d, f = cfg["d_model"], cfg["ffn_hidden_size"]
    if cfg["ffn_type"] == "moe":
        return _moe_per_token(cfg, compute, ep)
    if cfg["ffn_type"] == "glu":
        # gate and up each cast the input under autocast (two copies); gate out, act out, up out, product.
        inputs = (2 if autocast else 1) * compute * d
        return float(inputs + 4 * compute * f)
    return float(compute * d + 2 * compute * f)


def _moe_per_token(cfg: dict[str, Any], compute: int, ep: int) -> float:
    """What smalti-moe's dropless layer keeps per token for backward (:mod:`smalti.moe.ops`): the router's fp32
    input (a copy unless the FFN input is fp32 already), its fp32 logits and scores; per chosen expert the first
    GEMM's output (GLU: gate and up, kept by the fused GLU; MLP: the activation's input and output) and the second
    GEMM's rows the weighted combine keeps. Under expert parallelism each chosen expert's row also arrives by
    all-to-all (the first GEMM keeps it) and returns (the combine keeps it). The input itself is the norm's output,
    counted with the block."""
    d, f = cfg["d_model"], cfg["ffn_hidden_size"]
    experts, k, mlp_type = _moe_settings(cfg)
    router = (0 if compute == 4 else 4 * d) + 2 * 4 * experts
    hidden = (3 if mlp_type == "glu" else 2) * f
    routed = k * compute * (hidden + d + (2 * d if ep > 1 else 0))
    return float(router + routed)


def all_to_all_bytes(model: Any, tokens: float, compute: int, ep: int) -> float:
    """Bytes one GPU sends by all-to-all per micro batch of ``tokens`` under expert parallelism: every MoE layer
    sends each token's ``top_k`` rows out and back in forward, and their gradients in backward (the share that
    stays on the rank is left to the caller)."""
    cfg = model.config
    if ep <= 1 or cfg["ffn_type"] != "moe":
        return 0.0
    _, k, _ = _moe_settings(cfg)
    return 4.0 * cfg["n_layers"] * tokens * k * cfg["d_model"] * compute


def block_bytes_per_token(cfg: dict[str, Any], compute: int, residual: int, autocast: int | None,
                          ep: int = 1) -> dict[str, float]:
    """Bytes per token one block keeps for backward, by part: ``norm_1``, ``attention``, ``norm_2``, ``ffn``,
    and ``attn_in``/``ffn_in`` (the norm outputs that a checkpointed attention or FFN region keeps instead)."""
    d, h, kv_heads = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // h
    q, kv = h * hd, kv_heads * hd
    norm_keep, norm_out = _norm_bytes(cfg["norm_type"], residual, autocast)
    attn = compute * d + compute * (q + 2 * kv) + compute * q + 4 * h  # wqkv input, qkv, output, lse
    if cfg["position"] == "rope":
        attn += compute * (q + kv)  # rotated q and k are new tensors
    if cfg.get("qk_norm"):
        q_keep, q_out = _norm_bytes(cfg["norm_type"], compute, autocast)
        attn += (q_keep + q_out) * (q + kv)
    return {
        "norm_1": norm_keep * d,
        "attention": float(attn),
        "norm_2": norm_keep * d,
        "ffn": _ffn_per_token(cfg, compute, autocast, ep),
        "attn_in": norm_out * d,
        "ffn_in": norm_out * d,
    }


def activation_bytes(
    model: Any,
    micro_batch_size: int,
    seq_len: int,
    compute_bytes: int,
    residual_bytes: int,
    autocast_bytes: int | None,
    weight_bytes: int,
    sp: int = 1,
    sequence_id: bool = False,
    ep: int = 1,
) -> dict[str, float]:
    """Bytes of activation memory at the peak of one micro batch's forward and backward on one GPU.

    Args:
        model: an :class:`smalti.llm.LLM` (its ``config``, checkpointing choice and ``fused_loss`` are read).
        micro_batch_size, seq_len: the micro batch; under sequence parallelism each GPU holds ``seq_len / sp``
            positions (attention sees the whole sequence for ``n_heads / sp`` heads).
        compute_bytes: the dtype of matrix products (2 under bf16/fp16 autocast or FSDP bf16 parameters).
        residual_bytes: the dtype of the residual stream (that of the parameters the embedding is run with).
        autocast_bytes: the autocast dtype's size, or ``None`` without autocast.
        weight_bytes: the dtype of the output weight as forward sees it (its gradient has that dtype).
        sequence_id: batches carry ``sequence_id`` (packed documents masked from each other).
        ep: ranks an MoE layer's experts are split over (the routed rows then travel, and are kept, twice more).

    Returns named parts in bytes that sum to the peak: ``blocks`` (what the blocks keep for backward),
    ``masks``, ``head`` (final norm and hidden states, held into backward), ``loss or recompute`` (the larger
    of the loss's transient logits and one checkpointed region rebuilt in backward) and ``inputs``.
    """
    cfg = model.config
    n_layers, d, vocab = cfg["n_layers"], cfg["d_model"], cfg["vocab_size"]
    tokens = micro_batch_size * seq_len / sp
    parts = block_bytes_per_token(cfg, compute_bytes, residual_bytes, autocast_bytes, ep)
    lora = getattr(model, "lora_config", None) is not None
    adapters = lora_block_bytes_per_token(model, compute_bytes) if lora else 0.0
    full = parts["norm_1"] + parts["attention"] + parts["norm_2"] + parts["ffn"] + adapters
    kept = {
        None: full,
        "block": residual_bytes * d,
        # (LoRA's part of a block is counted whole for attention/ffn granularity: an over-estimate)
        "attention": parts["norm_1"] + parts["attn_in"] + parts["norm_2"] + parts["ffn"] + adapters,
        "ffn": parts["norm_1"] + parts["attention"] + parts["norm_2"] + parts["ffn_in"] + adapters,
    }
    rebuilt = {None: 0.0, "block": full, "attention": parts["attention"], "ffn": parts["ffn"]}
    chosen = {i: block.checkpointing for i, block in enumerate(model.blocks)}
    blocks = sum(kept[chosen.get(i)] for i in range(n_layers)) * tokens
    recompute = max((rebuilt[chosen.get(i)] for i in range(n_layers)), default=0.0) * tokens

    masks = _mask_bytes(cfg, seq_len, compute_bytes, sequence_id)
    if _masked(cfg, seq_len, sequence_id):
        # Tiled attention concatenates its tiles' outputs: one more attention-output copy per block and token.
        blocks += sum(1 for i in range(n_layers) if chosen.get(i) in (None, "ffn")) * tokens * compute_bytes * d
    norm_keep, norm_out = _norm_bytes(cfg["norm_type"], residual_bytes, autocast_bytes)
    rows = int(tokens)
    if getattr(model, "fused_loss", True):
        # Held into backward: the final norm's input, the hidden states, their gradient, and the weight
        # gradient (fp32, then cast to the weight's dtype). Transient in forward: one chunk's fp32 logits (and
        # under half precision the half copy of their gradient, the weight and the hidden states cast once).
        chunk = min(rows, max(1, CHUNK_ELEMENTS // vocab))
        half = compute_bytes != 4
        trains_head = _head_trains(model)
        head = rows * d * (norm_keep + 2 * norm_out)
        head += vocab * d * (4 + (weight_bytes if weight_bytes != 4 else 0)) if trains_head else 0
        loss_peak = chunk * vocab * (4 + (compute_bytes if half else 0))
        if half:
            loss_peak += vocab * d * compute_bytes + rows * d * compute_bytes
    else:
        # Held: the final norm's input and the projection's input; at the start of backward the logits, their
        # fp32 log-softmax and two fp32 gradients are alive at once.
        head = rows * d * (norm_keep + compute_bytes)
        loss_peak = rows * vocab * (compute_bytes + 12)
    # The loss's transient (end of forward / start of backward) and a recomputed block (later in backward)
    # are never alive together: the peak has the larger.
    transient = max(float(loss_peak), recompute)
    inputs = micro_batch_size * seq_len * 8 * (3 if sequence_id else 2)  # int64 ids, targets (and sequence ids)
    out = {"blocks": blocks, "masks": masks, "head": float(head), "loss or recompute": transient,
           "inputs": float(inputs)}
    if lora:
        out.update(lora_weight_bytes(model, compute_bytes, autocast_bytes))
        out.update(lora_expert_bytes(model, residual_bytes, autocast_bytes, ep, chosen))
    return out


def _head_trains(model: Any) -> bool:
    head = getattr(model, "lm_head", None)
    weight = head.weight if head is not None else model.wte.weight
    return bool(weight.requires_grad)


#: Bytes per weight of QLoRA's NF4 (torchao's ``NF4Tensor``): 4 bits, an int8 scale per 64 values and an fp32
#: factor per 256 scales.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)


def lora_block_bytes_per_token(model: Any, compute: int) -> float:
    """What LoRA adds to one block's activations per token: per adapted layer the dropout's output and mask
    (when ``dropout`` > 0) and the rank-``r`` products kept for ``B``'s gradient. The frozen base keeps no input
    of its own (its weight needs no gradient); the adapters' ``A`` keeps the layer input, as the full model's
    weight gradient did, so that part is already counted."""
    from smalti.llm.lora.layer import lora_layers

    config = model.lora_config
    per_token = 0.0
    for path, layer in lora_layers(model).items():
        if not path.startswith("blocks.0."):
            continue
        adapted = len(layer.lora_A)
        if adapted and config.dropout > 0:  # the mask, and the dropped input the A product keeps (cast)
            per_token += layer.in_features * (compute + 1)
        per_token += adapted * config.r * compute
    return per_token


def lora_weight_bytes(model: Any, compute: int, autocast: int | None) -> dict[str, float]:
    """LoRA's weight-sized transients: without autocast, the fp32 copies of a bf16 base that the products keep
    for backward; with an NF4 base, one layer's dequantised weight at a time."""
    from smalti.llm.lora.layer import lora_layers

    config = model.lora_config
    layers = lora_layers(model).values()
    out: dict[str, float] = {}
    if config.base_dtype == "bfloat16" and autocast is None and compute == 4:
        out["lora fp32 base copies"] = float(sum(layer.weight.numel() for layer in layers) * 4)
    if config.base_dtype == "nf4":
        out["nf4 dequantised weight"] = float(max((layer.weight.numel() for layer in layers), default=0)
                                              * (autocast or 2))
    return out


def lora_expert_bytes(model: Any, residual: int, autocast: int | None, ep: int,
                      checkpointing: dict[int, str | None]) -> dict[str, float]:
    """What LoRA on experts adds per rank: each adapted MoE layer folds its updates into the ``1 / ep`` of its
    experts the rank holds (``W + scaling * A^T B^T`` in the tokens' dtype, ``residual`` bytes, and under autocast
    a half copy for the grouped GEMM), kept for backward by every block that is not recomputed (one recomputed
    block's otherwise), plus one fp32 merged weight alive while it is formed (or its gradient in backward).
    The adapters themselves are trainable parameters: the plan counts them with their fp32 gradients and AdamW
    moments, sharded as FSDP2 shards them (over every rank, gathered whole for each layer)."""
    from smalti.llm.lora.experts import expert_lora_layers

    per_layer: dict[int, float] = {}
    for path, layer in expert_lora_layers(model).items():
        weights = sum(getattr(layer, name).numel() for name in layer.adapters.lora_A)
        per_layer[int(path.split(".")[1])] = weights / max(ep, 1)
    if not per_layer:
        return {}
    kept_bytes = residual + (autocast if autocast is not None and autocast < residual else 0)
    kept = sum(n for i, n in per_layer.items() if checkpointing.get(i) in (None, "attention"))
    if kept == 0:  # every adapted block is recomputed: one holds its merged experts in backward
        kept = max(per_layer.values())
    return {"lora merged experts kept": kept * kept_bytes,
            "lora merged experts transient": max(per_layer.values()) * 4.0}


def frozen_bytes(model: Any) -> float | None:
    """Bytes of the frozen parameters as held once loaded: a QLoRA base in NF4 (:data:`NF4_BYTES_PER_WEIGHT`),
    the rest in its dtype; ``None`` without LoRA."""
    config = getattr(model, "lora_config", None)
    if config is None:
        return None
    from smalti.llm.lora.layer import lora_layers

    quantised = {id(layer.weight) for layer in lora_layers(model).values()} if config.base_dtype == "nf4" else set()
    return float(sum(p.numel() * (NF4_BYTES_PER_WEIGHT if id(p) in quantised else p.element_size())
                     for p in model.parameters() if not p.requires_grad))


def _masked(cfg: dict[str, Any], seq_len: int, sequence_id: bool) -> bool:
    """Whether attention runs in tiles (:mod:`smalti.llm.model.attention_mask`) rather than one causal SDPA."""
    window = cfg.get("sliding_window")
    windowed = window is not None and window < seq_len
    uses_ids = sequence_id and cfg.get("attn_uses_sequence_id", True)
    return cfg["position"] == "alibi" or windowed or bool(uses_ids)


def _mask_bytes(cfg: dict[str, Any], seq_len: int, compute: int, sequence_id: bool) -> float:
    """The one bias tensor tiled attention shares across layers (ALiBi or sliding windows), in the compute dtype.
    Nothing ``T x T`` is held: document masks become per-span causal calls."""
    window = cfg.get("sliding_window")
    if cfg["position"] != "alibi" and (window is None or window >= seq_len):
        return 0.0
    from smalti.llm.model.attention_mask import BIAS_ELEMENTS, CHUNK_ROWS

    heads = cfg["n_heads"] if cfg["position"] == "alibi" else 1
    keys = seq_len if window is None or window >= seq_len else min(seq_len, CHUNK_ROWS + window - 1)
    return float(min(BIAS_ELEMENTS, heads * min(CHUNK_ROWS, seq_len) * keys) * compute)


def training_flops(model: Any, micro_batch_size: int, seq_len: int) -> float:
    """Training FLOPs of one micro batch by LLM Foundry's formula, through the model's own
    ``flops_per_batch`` (``3 * (2 * active params * T + n_layers * 4 * d_model * T^2) * B``)."""
    ids = torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    return float(model.flops_per_batch({"input_ids": ids}))


def published(experiment: str | None, gpu: str, gpus: int) -> list[str]:
    """LLM Foundry's published MFU and throughput for the experiment's model on ``gpu``, as lines to print."""
    if not experiment or experiment not in FOUNDRY_PUBLISHED:
        return []
    row = FOUNDRY_PUBLISHED[experiment].get(gpu)
    if row is None:
        return []
    n, mfu, tps = row
    note = "" if n == gpus else f" (published on {n} GPUs; this plan is for {gpus})"
    return [
        f"LLM Foundry published, {experiment} on {n}x{gpu.upper()}-80GB BF16 seq 2048: MFU {mfu:.2f}%, "
        f"{tps:,} tokens/s/GPU{note}",
        f"  source: {FOUNDRY_SOURCE}",
        "  Foundry's benchmark configs pick their own micro batch and activation checkpointing (its 7b row at seq "
        "2048: FSDP FULL_SHARD, amp_bf16, none; /work/shared/reference/trainer-anchors.md (c)), so compare the "
        "plan's HFU with the published MFU when this run checkpoints every block",
    ]


def _expert_adapter_note(model: Any) -> str:
    """How many of the adapter parameters sit on experts (empty without expert adapters)."""
    from smalti.llm.lora.experts import expert_lora_layers

    on_experts = sum(p.numel() for layer in expert_lora_layers(model).values() for p in layer.adapters.parameters())
    if not on_experts:
        return ""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f" ({trainable / 1e6:,.1f} M, {on_experts / 1e6:,.1f} M of them on the experts: a rank-r update per "
            "expert, sharded over every rank and gathered whole per layer)")


def _seq_len(cfg: Any, model: Any) -> int:
    train = (cfg.get("data") or {}).get("train") or {}
    value = train.get("max_seq_len") if hasattr(train, "get") else None
    return int(value) if isinstance(value, int) else int(model.max_seq_len)


def plan_model(model: Any, setup: Any) -> Any:
    """``smalti_plan_model`` for :class:`smalti.llm.LLM`: activation bytes, FLOPs and notes (else ``None``)."""
    from smalti.core.plan.types import ModelEstimate
    from smalti.llm.model.transformer import LLM

    if not isinstance(model, LLM):
        return None
    seq_len = _seq_len(setup.cfg, model)
    m = setup.micro_batch_size
    acts = activation_bytes(
        model, m, seq_len, setup.compute_bytes, setup.residual_bytes, setup.autocast_bytes, setup.weight_bytes,
        setup.sp, setup.sequence_id, getattr(setup, "ep", 1),
    )
    flops = training_flops(model, m, seq_len)
    # Recomputation repeats (part of) the forward: 1/3 of the training FLOPs per recomputed block.
    recomputed = sum(1 for block in model.blocks if block.checkpointing)
    hardware = flops * (1 + recomputed / max(model.n_layers, 1) / 3)
    notes = [f"sequence length {seq_len}; fused chunked loss {'on' if model.fused_loss else 'off'}; "
             f"activation checkpointing on {recomputed} of {model.n_layers} blocks"]
    a2a = 0.0
    if model.config["ffn_type"] == "moe":
        experts, k, _ = _moe_settings(model.config)
        ep = getattr(setup, "ep", 1)
        a2a = all_to_all_bytes(model, m * seq_len / setup.sp, setup.compute_bytes, ep)
        notes.append(f"MoE: {experts} experts, top-{k}: {model.n_active_params / 1e9:,.2f} B of "
                     f"{model.n_params / 1e9:,.2f} B parameters active per token (FLOPs and MFU count the active "
                     f"ones); experts split over ep={ep}"
                     + (f", {a2a / 2**30:,.2f} GiB sent by all-to-all per micro batch and GPU" if a2a else ""))
    if model.lora_config is not None:
        lora = model.lora_config
        notes.append(f"LoRA r={lora.r} on {','.join(lora.targets)}, base held in {lora.base_dtype}"
                     + (" (NF4: 4 bits + block scales, ~0.52 B/param)" if lora.base_dtype == "nf4" else "")
                     + "; adapters fp32 with gradients and optimizer state" + _expert_adapter_note(model))
    notes.extend(published(setup.experiment, setup.gpu, setup.world_size))
    return ModelEstimate(activations=acts, flops=flops, hardware_flops=hardware, tokens=m * seq_len, notes=notes,
                         frozen_bytes=frozen_bytes(model), all_to_all_bytes=a2a)
