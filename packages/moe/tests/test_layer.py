"""Tier 1 (CPU, torch backend): the layer against a per-token loop, layer equalities, gradients, edge cases."""

import pytest
import torch

from smalti.moe import MoE, MoEError, load_balancing_loss, router_z_loss
from smalti.moe.layer import dense_ffn_reference


def make(**kw):
    torch.manual_seed(0)
    args = dict(hidden_size=24, ffn_hidden_size=16, num_experts=4, top_k=2)
    args.update(kw)
    return MoE(**args)


def per_token_loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The obvious implementation: every token, every chosen expert, one at a time."""
    routing = layer.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            e = int(routing.expert_ids[t, j])
            h = dense_ffn_reference(x[t : t + 1], layer.w1[e], layer.w2[e], layer.mlp_type, layer.activation,
                                    layer.ffn_hidden_size)
            out[t] += routing.weights[t, j] * h[0]
    return out


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_matches_per_token_loop(mlp_type, score_func):
    layer = make(mlp_type=mlp_type, score_func=score_func, activation="silu" if mlp_type == "glu" else "gelu",
                 normalize_expert_weights=1.0 if score_func == "sigmoid" else None)
    x = torch.randn(37, 24)
    y, _ = layer(x)
    torch.testing.assert_close(y, per_token_loop(layer, x), rtol=1e-5, atol=1e-6)


def test_gradients_match_per_token_loop():
    layer = make(mlp_type="glu", activation="silu", num_experts=5, top_k=3, zloss_weight=1e-3)
    loop = make(mlp_type="glu", activation="silu", num_experts=5, top_k=3, zloss_weight=1e-3)
    x = torch.randn(21, 24)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = layer(xa)
    (y.square().sum() + aux).backward()
    (per_token_loop(loop, xb).square().sum() + loop.aux_loss(loop.router(xb))).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-6)
    for (name, a), b in zip(layer.named_parameters(), loop.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_glu_experts_keep_no_activation_output_for_backward():
    """The torch backend's fused GLU + second GEMM keeps only the first GEMM's output ``[N, 2F]`` for backward;
    the GLU output ``[N, F]`` is recomputed there (the memory a Mixtral-like step saves)."""
    layer = make(mlp_type="glu", activation="silu", num_experts=4, top_k=2)
    x = torch.randn(13, 24, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y, _ = layer(x)
    entries = 13 * 2
    assert (entries, 2 * 16) in saved
    assert (entries, 16) not in saved, saved
    y.sum().backward()
    assert layer.w1.grad is not None and layer.w2.grad is not None


def test_one_expert_equals_dense_ffn():
    layer = make(num_experts=1, top_k=1, mlp_type="glu", activation="silu")
    x = torch.randn(2, 9, 24)
    y, _ = layer(x)
    dense = dense_ffn_reference(x, layer.w1[0], layer.w2[0], "glu", "silu", 16)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)


def test_dropless_equals_capacity_when_capacity_is_large():
    dropless = make()
    capped = make(capacity_factor=float(dropless.num_experts))  # capacity = k * T: nothing can be dropped
    capped.load_state_dict(dropless.state_dict())
    x = torch.randn(50, 24)
    torch.testing.assert_close(capped(x)[0], dropless(x)[0])


def test_small_capacity_drops_later_tokens_first():
    layer = make(num_experts=2, top_k=1, capacity_factor=0.5)  # capacity = int(0.5 * 1 * T / 2) = T // 4
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0, 0] = 10.0  # every token with x[:, 0] > 0 goes to expert 0
    x = torch.randn(16, 24).abs()
    y, _ = layer(x)
    kept = (y.abs().sum(-1) > 0).tolist()
    assert kept == [True] * 4 + [False] * 12


def test_gradcheck_float64():
    layer = make(hidden_size=6, ffn_hidden_size=5, num_experts=3, top_k=2, mlp_type="glu", activation="silu",
                 dtype=torch.float64)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)

    def fn(x, w1, w2):
        return torch.func.functional_call(layer, {"w1": w1, "w2": w2}, (x,))[0]

    w1 = layer.w1.detach().clone().requires_grad_()
    w2 = layer.w2.detach().clone().requires_grad_()
    # Routing is piecewise constant in x, so gradcheck holds away from ties (random inputs have none).
    assert torch.autograd.gradcheck(fn, (x, w1, w2), eps=1e-6, atol=1e-5)


def test_expert_with_no_tokens_gets_zero_gradient():
    layer = make(num_experts=4, top_k=1)
    with torch.no_grad():
        layer.router.gate.weight[3] = -100.0  # with positive inputs, expert 3 is never chosen
    x = torch.randn(20, 24).abs()
    y, _ = layer(x)
    y.sum().backward()
    assert layer.w1.grad[3].abs().sum() == 0 and layer.w1.grad[:3].abs().sum() > 0


@pytest.mark.parametrize(("tokens", "k", "hidden"), [(1, 2, 24), (9, 4, 24), (13, 2, 40)])
def test_edge_shapes(tokens, k, hidden):
    layer = make(hidden_size=hidden, top_k=k)
    x = torch.randn(tokens, hidden)
    torch.testing.assert_close(layer(x)[0], per_token_loop(layer, x), rtol=1e-5, atol=1e-6)


def test_balancing_loss_formula_and_balanced_value():
    probs = torch.full((8, 4), 0.25)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(probs, ids, 4, 0.1) == pytest.approx(0.1)  # perfectly balanced: the weight
    probs = torch.softmax(torch.randn(8, 4), -1)
    counts = torch.bincount(ids.reshape(-1), minlength=4).float()
    expected = 0.1 * 4 / (8 * 2) * (counts * probs.mean(0)).sum()
    assert load_balancing_loss(probs, ids, 4, 0.1) == pytest.approx(float(expected))
    logits = torch.randn(5, 4)
    assert router_z_loss(logits, 1e-3) == pytest.approx(float(1e-3 * torch.logsumexp(logits, -1).pow(2).mean()))


def test_layer_scope_losses_leave_padding_out():
    """``lbl_scope='layer'`` with ``token_weights``: the balancing loss and z-loss are those of the real tokens
    alone (the padding is still routed), with the router's gradient from them only."""
    layer = make(lbl_weight=0.1, zloss_weight=1e-3, num_layers=2).train()
    x = torch.randn(2, 6, 24)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    _, masked = layer(x, mask)
    parts = dict(layer.last_losses)
    (grad,) = torch.autograd.grad(masked, layer.router.gate.weight)
    _, real = layer(x[mask.bool()])
    (expected_grad,) = torch.autograd.grad(real, layer.router.gate.weight)
    torch.testing.assert_close(masked, real, rtol=1e-6, atol=1e-7)
    for name, value in layer.last_losses.items():
        torch.testing.assert_close(parts[name], value, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    _, unmasked = layer(x)
    assert abs(float(unmasked - masked)) > 1e-6  # the padding would have counted


def test_aux_loss_is_returned_per_layer_and_off_in_eval():
    layer = make(lbl_weight=0.1, zloss_weight=1e-3)
    _, loss = layer(torch.randn(10, 24))
    assert loss.item() > 0.09  # about the weight when near-balanced, plus the z-loss
    layer.eval()
    assert layer(torch.randn(10, 24))[1].item() == 0.0


def test_aux_free_bias_moves_toward_balance():
    layer = make(num_experts=4, top_k=1, load_balancing="aux_free")
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0, 0] = 5.0
    layer(torch.randn(64, 24).abs())
    assert layer.tokens_per_expert[0] == 64
    layer.update_expert_bias(coeff=0.1)
    bias = layer.router.expert_bias
    assert bias[0] < 0 and (bias[1:] > 0).all() and abs(float(bias.sum())) < 1e-6
    assert layer.tokens_per_expert.sum() == 0


def test_bad_arguments_name_the_value():
    with pytest.raises(MoEError, match="mlp_type='swiglu'"):
        make(mlp_type="swiglu")
    with pytest.raises(MoEError, match="top_k=5"):
        make(top_k=5)


def test_triton_backend_on_cpu_says_why_not(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would make it runnable
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(MoEError, match="backend='triton' cannot run: .*(CUDA|not installed)"):
        make(backend="triton")


def test_sigmoid_aux_free_selects_by_biased_score_but_weights_by_unbiased():
    layer = make(num_experts=4, top_k=2, score_func="sigmoid", load_balancing="aux_free", normalize_expert_weights=1.0)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 always selected
    x = torch.randn(16, 24)
    routing = layer.router(x)
    assert (routing.expert_ids == 3).any(-1).all()
    scores = torch.sigmoid(layer.router.gate(x))
    picked = scores.gather(-1, routing.expert_ids)
    torch.testing.assert_close(routing.weights, picked / picked.sum(-1, keepdim=True))


def test_jitter_only_in_training():
    layer = make(router_jitter=0.5)
    x = torch.randn(64, 24)
    layer.eval()
    torch.testing.assert_close(layer(x)[0], layer(x)[0])
    layer.train()
    torch.manual_seed(1)
    ids_a = layer.router(x).expert_ids
    torch.manual_seed(2)
    ids_b = layer.router(x).expert_ids
    assert not torch.equal(ids_a, ids_b)  # multiplicative noise of +-50% changes some choices


def test_normalized_weights_sum_to_one_and_raw_softmax_weights_do_not():
    x = torch.randn(10, 24)
    assert torch.allclose(make(normalize_expert_weights=1.0).router(x).weights.sum(-1), torch.ones(10))
    assert (make().router(x).weights.sum(-1) < 1).all()


def test_shared_experts_are_added_to_the_routed_output():
    layer = make(num_shared_experts=2)
    x = torch.randn(11, 24)
    routed_only = per_token_loop(layer, x)
    torch.testing.assert_close(layer(x)[0], routed_only + layer.shared(x), rtol=1e-5, atol=1e-6)
    assert layer.shared[0].out_features == 2 * layer.ffn_hidden_size


def test_balancing_loss_scales_with_num_layers_and_parts_are_kept_per_layer():
    one, four = make(zloss_weight=1e-3), make(zloss_weight=1e-3, num_layers=4)
    four.load_state_dict(one.state_dict())
    x = torch.randn(30, 24)
    one(x), four(x)
    lbl1, lbl4 = one.last_losses["load_balancing_loss"], four.last_losses["load_balancing_loss"]
    torch.testing.assert_close(lbl4 * 4, lbl1)
    torch.testing.assert_close(one.last_losses["router_z_loss"], four.last_losses["router_z_loss"])
    other = make()
    assert other.last_losses == {}  # nothing shared between layers


def test_router_logits_stay_fp32_under_autocast_and_bf16_layer_runs():
    layer = make()
    x = torch.randn(12, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(x)
    assert routing.logits.dtype == torch.float32
    torch.testing.assert_close(routing.logits, x @ layer.router.gate.weight.t())
    bf16 = make(dtype=torch.bfloat16)
    y, aux = bf16(x.bfloat16())
    assert y.dtype == torch.bfloat16 and aux.dtype == torch.float32
    ref = make()
    ref.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    want = ref(x.bfloat16().float())[0]
    assert float((y.detach().float() - want.detach()).norm() / want.detach().norm()) < 3e-2  # bf16 rounding of two GEMMs and the combine


def test_model_scope_pools_shares_and_probabilities_over_layers_before_their_product():
    """``lbl_scope='model'``: each layer returns its statistics; their pooled loss is the Switch loss over the
    layers' tokens concatenated (Hugging Face's ``load_balancing_loss_func``), not the sum of per-layer losses."""
    from smalti.moe.losses import pooled_load_balancing_loss

    layers = [make(lbl_scope="model", lbl_weight=0.3, normalize_expert_weights=1.0) for _ in range(2)]
    torch.manual_seed(5)
    layers[1].router.gate.weight.data.mul_(8)  # the second layer routes far less evenly than the first
    x = torch.randn(40, 24)
    stats = [layer(x)[1] for layer in layers]
    assert [s.shape for s in stats] == [torch.Size([9])] * 2
    loss = pooled_load_balancing_loss(torch.stack(stats).sum(0), 4, 0.3)
    logits = torch.cat([layer.router(x).logits for layer in layers])
    probs = logits.softmax(-1)
    shares = torch.zeros(4).index_add_(0, probs.topk(2, -1).indices.reshape(-1), torch.ones(160)) / 80
    torch.testing.assert_close(loss, 0.3 * 4 * (shares * probs.mean(0)).sum())
    per_layer = sum(pooled_load_balancing_loss(s, 4, 0.3) for s in stats)
    assert abs(float(per_layer.detach()) - float(loss.detach())) > 1e-3
    loss.backward()
    assert all(layer.router.gate.weight.grad.abs().max() > 0 for layer in layers)
    for layer in layers:
        layer.eval()
    assert all(layer(x)[1].dim() == 0 and float(layer(x)[1]) == 0.0 for layer in layers)
    with pytest.raises(MoEError, match="lbl_scope='nope'"):
        make(lbl_scope="nope")


def test_jitter_experts_feeds_the_jittered_input_to_the_experts_too():
    layer = make(router_jitter=0.3, jitter_experts=True)
    x = torch.randn(32, 24)
    layer.train()
    torch.manual_seed(3)
    y = layer(x)[0]
    torch.manual_seed(3)
    jittered = x * torch.empty_like(x).uniform_(0.7, 1.3)
    layer.eval()
    torch.testing.assert_close(y, layer(jittered)[0])  # eval: no jitter, so this is the jittered forward
    assert not torch.allclose(layer(x)[0], y)
