"""The transformer: masking, positions, GQA, norms, checkpointing, MoE losses and the FLOP count."""

from __future__ import annotations

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.errors import ModelConfigError
from smalti.llm.model.checkpointing import checkpointed_layers

TINY = dict(d_model=64, n_heads=4, n_layers=2, vocab_size=97, max_seq_len=32)


def _model(**kw):
    torch.manual_seed(0)
    return LLM(**{**TINY, **kw})


@pytest.mark.parametrize("position", ["rope", "alibi", "learned", "none"])
def test_packed_documents_do_not_attend_to_each_other(position):
    model = _model(position=position).eval()
    ids = torch.randint(0, 97, (2, 32))
    seq = torch.cat([torch.zeros(2, 12, dtype=torch.long), torch.ones(2, 20, dtype=torch.long)], 1)
    changed = ids.clone()
    changed[:, :12] = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        a = model({"input_ids": ids, "sequence_id": seq})["logits"]
        b = model({"input_ids": changed, "sequence_id": seq})["logits"]
        c = model({"input_ids": changed})["logits"]
    torch.testing.assert_close(a[:, 12:], b[:, 12:])
    assert (a[:, 12:] - c[:, 12:]).abs().max() > 1e-4  # without sequence ids the first document is seen


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model(position="alibi", n_kv_heads=2, qk_norm=True, norm_type="rmsnorm", ffn_type="glu").eval()
    ids = torch.randint(0, 97, (1, 32))
    other = ids.clone()
    other[:, 20:] = (other[:, 20:] + 1) % 97
    with torch.no_grad():
        a, b = model({"input_ids": ids})["logits"], model({"input_ids": other})["logits"]
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-4


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = _model(n_kv_heads=1).eval()
    mha = _model().eval()
    hd = 16
    with torch.no_grad():
        sd = gqa.state_dict()
        for i in range(2):
            q, k, v = sd[f"blocks.{i}.attn.wqkv.weight"].split([64, hd, hd])
            sd[f"blocks.{i}.attn.wqkv.weight"] = torch.cat([q, k.repeat(4, 1), v.repeat(4, 1)])
        mha.load_state_dict(sd)
        ids = torch.randint(0, 97, (2, 16))
        torch.testing.assert_close(gqa({"input_ids": ids})["logits"], mha({"input_ids": ids})["logits"])


def test_loss_ignores_masked_labels_and_tied_untied_param_counts():
    model = _model()
    ids = torch.randint(0, 97, (2, 16))
    labels = ids.clone()
    labels[:, :8] = -100
    out = model({"input_ids": ids})
    full = model.loss(out, {"input_ids": ids})
    part = model.loss(out, {"input_ids": ids, "labels": labels})
    logits = out["logits"][:, 7:15].reshape(-1, 97)
    expected = torch.nn.functional.cross_entropy(logits, ids[:, 8:16].reshape(-1))
    torch.testing.assert_close(part, expected)
    assert not torch.isclose(full, part)
    assert _model(tie_embeddings=False).n_params == model.n_params + 97 * 64


@pytest.mark.parametrize("granularity", ["block", "attention", "ffn"])
def test_activation_checkpointing_gives_the_same_gradients(granularity):
    ids = torch.randint(0, 97, (2, 32))
    grads = []
    for spec in (None, {"granularity": granularity, "layers": "range(1, 2)"}):
        model = _model(activation_checkpointing=spec)
        model.loss(model({"input_ids": ids}), {"input_ids": ids}).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert [b.checkpointing for b in _model(activation_checkpointing={"granularity": granularity,
                                                                      "layers": "range(1, 2)"}).blocks] == [None, granularity]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_checkpoint_layer_specs():
    assert checkpointed_layers("all", 4) == [0, 1, 2, 3]
    assert checkpointed_layers(2, 4) == [0, 1]
    assert checkpointed_layers("range(1, 3)", 4) == [1, 2]
    assert checkpointed_layers("every(2)", 5) == [0, 2, 4]
    with pytest.raises(ModelConfigError, match="every"):
        checkpointed_layers("each other", 4)


def test_flops_follow_llm_foundry_formula():
    model = _model(position="learned")
    batch = {"input_ids": torch.zeros(3, 32, dtype=torch.long)}
    n = model.n_params - 32 * 64  # position table excluded
    expected = 3 * (2 * n * 32 + 2 * 2 * 2 * 64 * 32**2) * 3
    assert model.flops_per_batch(batch) == expected


def test_mpt_125m_size_on_meta_device():
    model = LLM(d_model=768, n_heads=12, n_layers=12, vocab_size=50368, max_seq_len=2048, position="learned",
                norm_type="low_precision_layernorm", init_device="meta")
    assert next(model.parameters()).is_meta
    assert 120e6 < model.n_params < 130e6  # Foundry's table: 125.3M


def test_low_precision_norms_run_in_bf16_under_autocast():
    model = _model(norm_type="low_precision_rmsnorm")
    ids = torch.randint(0, 97, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.blocks[0].norm_1(model.wte(ids))
    assert h.dtype == torch.bfloat16


def test_bad_shapes_name_the_key():
    with pytest.raises(ModelConfigError, match="n_kv_heads"):
        LLM(d_model=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ModelConfigError, match="norm_type"):
        LLM(norm_type="batchnorm")


def test_moe_ffn_adds_its_aux_loss():
    model = _model(ffn_type="moe", moe={"num_experts": 4, "top_k": 2, "loss_weight": 0.1})
    ids = torch.randint(0, 97, (2, 16))
    out = model({"input_ids": ids})
    assert "aux_loss" in out and out["aux_loss"] > 0
    ce = torch.nn.functional.cross_entropy(out["logits"][:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(model.loss(out, {"input_ids": ids}), ce + out["aux_loss"])
    assert model.n_active_params < model.n_params


def test_moe_balancing_loss_is_scaled_by_the_layer_count():
    weight = 0.1
    model = _model(n_layers=4, ffn_type="moe", moe={"num_experts": 4, "top_k": 2, "loss_weight": weight})
    assert [b.ffn.moe.num_layers for b in model.blocks] == [4] * 4
    out = model({"input_ids": torch.randint(0, 97, (4, 32))})
    parts = [b.ffn.moe.last_losses["load_balancing_loss"] for b in model.blocks]
    torch.testing.assert_close(out["aux_loss"], torch.stack(parts).sum())
    # MegaBlocks' batched loss: about `weight` for a near-balanced router, not n_layers * weight.
    assert 0.9 * weight < float(out["aux_loss"].detach()) < 2 * weight


def test_meta_device_moe_gets_every_weight_initialised():
    model = LLM(**TINY, ffn_type="moe", moe={"num_experts": 4, "top_k": 2}, init_device="meta")
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.constant_(p, float("nan"))
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    w1 = model.blocks[0].ffn.moe.w1
    assert 0.01 < float(w1.detach().std()) < 0.03  # normal(0, init_std=0.02), not left as it was


@pytest.mark.parametrize("kw", [
    dict(position="learned", norm_type="low_precision_layernorm", bias=True, tie_embeddings=True),
    dict(position="rope", norm_type="rmsnorm", ffn_type="glu", n_kv_heads=2, tie_embeddings=False, qk_norm=True),
    dict(position="alibi", ffn_type="moe", moe={"num_experts": 4, "top_k": 2, "load_balancing": "aux_free"}),
], ids=["mpt", "llama", "moe"])
def test_meta_built_model_gets_the_same_init_as_a_cpu_built_one(kw):
    """What the trainer does with a recipe's meta model (to_empty, then init_weights) gives exactly the weights
    and buffers a CPU-built model's init_weights gives from the same seed, whatever memory to_empty handed out."""
    cfg = {**TINY, "n_layers": 3, **kw}
    on_cpu = LLM(**cfg)
    on_meta = LLM(**cfg, init_device="meta")
    assert all(t.is_meta for t in [*on_meta.parameters(), *on_meta.buffers()])
    on_meta.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*on_meta.parameters(), *on_meta.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else 7)
    torch.manual_seed(3)
    on_cpu.init_weights()
    torch.manual_seed(3)
    on_meta.init_weights()
    cpu_state = {**dict(on_cpu.named_parameters()), **dict(on_cpu.named_buffers())}
    meta_state = {**dict(on_meta.named_parameters()), **dict(on_meta.named_buffers())}
    assert cpu_state.keys() == meta_state.keys()
    for name, value in cpu_state.items():
        torch.testing.assert_close(meta_state[name], value, msg=name)
    # The distribution itself: normal(0, init_std) with the residual projections scaled by 1/sqrt(2 n_layers).
    std = on_meta.init_std
    assert abs(float(on_meta.wte.weight.detach().std()) - std) < 0.1 * std
    if "moe" not in kw:
        residual = torch.cat([b.ffn.down_proj.weight.detach().flatten() for b in on_meta.blocks])
        assert abs(float(residual.detach().std()) - std / (2 * 3) ** 0.5) < 0.1 * std / (2 * 3) ** 0.5
    out = on_meta({"input_ids": torch.randint(0, 97, (2, 16))})["logits"]
    assert torch.isfinite(out).all()
