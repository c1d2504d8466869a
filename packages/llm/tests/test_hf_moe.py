"""Mixture-of-experts families from Hugging Face on smalti-moe's dropless layer: tiny random models written by
``transformers`` (fp32) give its logits with the same experts chosen for every token, its auxiliary
load-balancing loss for a batch with the router's gradient, from per-expert or fused expert files; fields smalti
cannot reproduce fail at build naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from smalti.llm.errors import ConversionError
from smalti.llm.hf import PretrainedLLM, import_hf
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402

FAMILIES = {
    "mixtral": {},
    "qwen3_moe": {},
    "qwen3_moe-norm_topk_prob": {"norm_topk_prob": True},
    "olmoe": {},
    "qwen2_moe": {},
    "dbrx": {},
    "dbrx-p2_jitter": {"ffn_config": {"moe_normalize_expert_weights": 2.0, "moe_jitter_eps": 0.01}},
}
#: each family's router weight of layer {i}, when not model.layers.{i}.mlp.gate.weight
ROUTERS = {"dbrx": "transformer.blocks.{i}.ffn.router.layer.weight"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory) -> Path:
    family = request.param.split("-")[0]
    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), family, **FAMILIES[request.param])


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)


def _chosen_experts(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """Hooks recording every smalti MoE layer's expert ids per token (sorted within the token)."""
    from smalti.moe import MoE

    seen: list[torch.Tensor] = []
    handles = [m.router.register_forward_hook(lambda _m, _a, out: seen.append(out.expert_ids.sort(-1).values))
               for m in model.modules() if isinstance(m, MoE)]
    return seen, handles


def test_logits_and_chosen_experts_equal_transformers(folder):
    ids = _ids()
    hf, model = _hf(folder).eval(), import_hf(folder).eval()
    seen, _ = _chosen_experts(model)
    with torch.no_grad():
        theirs = hf(ids, output_router_logits=True)
        ours = model({"input_ids": ids})["logits"]
    assert theirs.logits.std() > 0.1
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=1e-4)
    top_k = model.config["moe"]["top_k"]
    hf_chosen = [logits.softmax(-1).topk(top_k, -1).indices.sort(-1).values for logits in theirs.router_logits]
    assert len(seen) == len(hf_chosen) == model.n_layers
    for layer, (a, b) in enumerate(zip(seen, hf_chosen, strict=True)):
        assert torch.equal(a, b), f"layer {layer} routes tokens to other experts"
        assert len(a.unique()) > 1  # the tokens do not all go to the same experts
    assert model.n_params == sum(p.numel() for p in hf.parameters())


def test_aux_loss_and_its_router_gradient_equal_transformers(folder):
    """``output_router_logits``: the loss is cross-entropy + ``router_aux_loss_coef`` times the load-balancing
    loss pooled over the layers, and the router's gradient from it is transformers'."""
    cfg = json.loads((folder / "config.json").read_text())
    family = cfg["model_type"]
    coef = cfg["ffn_config"]["moe_loss_weight"] if family == "dbrx" else cfg["router_aux_loss_coef"]
    ids = _ids(1)
    hf, model = _hf(folder).train(), import_hf(folder).train()
    if cfg.get("ffn_config", {}).get("moe_jitter_eps"):  # random in training on both sides: compare without it
        for block in hf.transformer.blocks:
            block.ffn.router.moe_jitter_eps = None
        for block in model.blocks:
            block.ffn.moe.router.jitter_eps = 0.0
    theirs = hf(ids, labels=ids)
    ours = model({"input_ids": ids})
    torch.testing.assert_close(ours["aux_loss"], coef * theirs.aux_loss.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.loss(ours, {"input_ids": ids}), theirs.loss, atol=1e-5, rtol=1e-5)
    (coef * theirs.aux_loss).backward()
    ours["aux_loss"].backward()
    name = ROUTERS.get(family, "model.layers.{i}.mlp.gate.weight")
    for i in range(2):
        hf_router = dict(hf.named_parameters())[name.format(i=i)].grad
        router = model.blocks[i].ffn.moe.router.gate.weight.grad
        assert router is not None and router.abs().max() > 0
        torch.testing.assert_close(router, hf_router, atol=1e-7, rtol=1e-4)


def test_aux_loss_leaves_padding_out_as_transformers_does(folder):
    """A right-padded batch: transformers' ``load_balancing_loss_func(..., attention_mask)`` counts only the
    unpadded tokens, and so does smalti given the batch's ``attention_mask``."""
    cfg = json.loads((folder / "config.json").read_text())
    family = cfg["model_type"]
    coef = cfg["ffn_config"]["moe_loss_weight"] if family == "dbrx" else cfg["router_aux_loss_coef"]
    ids = _ids(4)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[0, 20:] = 0
    hf, model = _hf(folder).train(), import_hf(folder).train()
    if family == "dbrx":
        for block in hf.transformer.blocks:
            block.ffn.router.moe_jitter_eps = None
        for block in model.blocks:
            block.ffn.moe.router.jitter_eps = 0.0
    theirs = hf(ids, attention_mask=mask, output_router_logits=True).aux_loss
    ours = model({"input_ids": ids, "attention_mask": mask})["aux_loss"]
    torch.testing.assert_close(ours, coef * theirs.float(), atol=1e-6, rtol=0)
    unmasked = model({"input_ids": ids})["aux_loss"]
    assert abs(unmasked.item() - ours.item()) > 1e-5  # the padding does weigh when it is not left out
    ours.backward()
    assert model.blocks[0].ffn.moe.router.gate.weight.grad.abs().max() > 0


def test_without_output_router_logits_no_aux_loss_is_added(folder, tmp_path):
    import shutil

    edited = tmp_path / "no_aux"
    shutil.copytree(folder, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "output_router_logits": False}))
    ids = _ids(1)
    out = import_hf(edited).train()({"input_ids": ids})
    assert float(out.get("aux_loss", 0.0)) == 0.0


def test_fused_expert_files_import_as_the_per_expert_ones(folder, tmp_path):
    """A folder holding the experts fused (``mlp.experts.gate_up_proj`` / ``down_proj``, the layout transformers
    keeps in memory) imports to the same model, and transformers reads it the same too."""
    import shutil

    from safetensors.torch import load_file, save_file

    if json.loads((folder / "config.json").read_text())["model_type"] == "dbrx":
        return  # DBRX folders hold only the fused layout (ffn.experts.mlp.w1/v1/w2): the other tests import it
    hf = _hf(folder)
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    (fused / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(fused / "model.safetensors")))
    ids = _ids(2)
    with torch.no_grad():
        a = import_hf(folder).eval()({"input_ids": ids})["logits"]
        b = import_hf(fused).eval()({"input_ids": ids})["logits"]
        c = _hf(fused).eval()(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(b, c, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("family", "changes", "named"), [
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mixtral", {"router_jitter_noise": 1.5}, "router_jitter_noise=1.5"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("qwen2_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    ("dbrx", {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 0.3, "attn_pdrop": 0.1}},
     "attn_config.attn_pdrop=0.1"),
    ("dbrx", {"ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2,
                             "moe_normalize_expert_weights": 0}}, "moe_normalize_expert_weights=0"),
    ("dbrx", {"ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2,
                             "ffn_act_fn": {"name": "gelu"}}}, "ffn_act_fn"),
    ("dbrx", {"ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2,
                             "uniform_expert_assignment": True}}, "ffn_config.uniform_expert_assignment=True"),
    ("dbrx", {"ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2,
                             "moe_jitter_eps": 1.5}}, "moe_jitter_eps=1.5"),
    ("dbrx", {"rope_parameters": None}, "attn_config.rope_theta=500000.0"),
    ("dbrx", {"tie_word_embeddings": True}, "tie_word_embeddings=true"),
])
def test_fields_smalti_cannot_reproduce_fail_at_build_naming_them(tmp_path, family, changes, named):
    folder = write_tiny_hf_model(tmp_path, family)
    cfg = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=named) as info:
        PretrainedLLM(folder)
    assert str(folder / "config.json") in str(info.value)
