"""The Hugging Face family registry (built-in families, entry points of other distributions) and the rule that
a folder's safetensors index names files inside that folder only."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest
import torch
import transformers

from smalti.llm.errors import ConversionError
from smalti.llm.hf import import_hf, registry
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402


def _shard(folder, moved_to, index_entry: str):
    """Move ``folder``'s weights to ``moved_to`` and write an index naming ``index_entry`` for every tensor."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    moved_to.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(folder / "model.safetensors", moved_to)
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, index_entry)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


@pytest.mark.parametrize("entry", ["../other/model.safetensors", "ABSOLUTE", "sub/../../other/model.safetensors"])
def test_an_index_naming_a_file_outside_its_folder_is_refused_naming_file_and_entry(tmp_path, entry):
    folder = write_tiny_hf_model(tmp_path / "model", "llama")
    other = tmp_path / "other" / "model.safetensors"  # a readable file, but outside the model's folder
    entry = str(other) if entry == "ABSOLUTE" else entry
    names = _shard(folder, other, entry)
    with pytest.raises(ConversionError, match="points outside") as info:
        import_hf(folder)
    message = str(info.value)
    assert str(folder / "model.safetensors.index.json") in message and repr(entry) in message
    assert repr(names[0]) in message


def test_an_index_naming_files_inside_its_folder_loads(tmp_path):
    folder = write_tiny_hf_model(tmp_path / "model", "llama")
    _shard(folder, folder / "shards" / "all.safetensors", "shards/all.safetensors")
    ids = torch.arange(20)[None]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(import_hf(folder).eval()({"input_ids": ids})["logits"], hf(ids).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as if no family had been looked up yet in this process (restored afterwards)."""
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_loaded", False)
    return registry


def test_a_distribution_adds_a_family_by_entry_point(tmp_path, monkeypatch, fresh_registry):
    """A family installed by another distribution (a real dist-info with an entry point on ``sys.path``) is
    found by ``model_type`` and imports with transformers' logits; the importer names no family."""
    site = tmp_path / "site"
    (site / "acme_family-1.0.dist-info").mkdir(parents=True)
    (site / "acme_family-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-family\n"
                                                                   "Version: 1.0\n")
    (site / "acme_family-1.0.dist-info" / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\nacme = acme_family:FAMILY\n")
    (site / "acme_family.py").write_text(textwrap.dedent('''
        from smalti.llm.hf.families.llama import Llama

        class Acme(Llama):
            """A Llama under another model_type (what a finetuning lab's fork often is)."""
            model_type = "acme"
            description = "Acme"

        FAMILY = Acme()
    '''))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "acme_family", raising=False)
    assert "acme" in fresh_registry.families()
    folder = write_tiny_hf_model(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "acme"}))
    model = import_hf(folder).eval()
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    ids = torch.arange(24)[None]
    with torch.no_grad():
        torch.testing.assert_close(model({"input_ids": ids})["logits"], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_broken_entry_point_is_named(tmp_path, monkeypatch, fresh_registry):
    site = tmp_path / "site"
    (site / "broken-1.0.dist-info").mkdir(parents=True)
    (site / "broken-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (site / "broken-1.0.dist-info" / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\nbroken = no_such_module_here:FAMILY\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ConversionError, match="broken=.no_such_module_here:FAMILY"):
        fresh_registry.families()


def test_register_refuses_what_is_not_a_family(fresh_registry):
    with pytest.raises(ConversionError, match="is not a smalti.llm.hf.family.Family"):
        fresh_registry.register(object())  # type: ignore[arg-type]


def test_a_model_no_family_fits_is_refused_with_each_familys_reason():
    from smalti.llm import LLM

    config = LLM(d_model=32, n_heads=4, n_layers=1, position="alibi", norm_type="rmsnorm", init_device="meta").config
    with pytest.raises(ConversionError, match=r"llama: position='alibi'.*mpt: norm_type='rmsnorm'"):
        registry.family_of(config)


def test_parts_lay_out_fused_transposed_and_stacked_tensors():
    """What an MoE family relies on: a ``stacked`` part is one expert (index ``start``) of a stacked weight,
    a ``transposed`` part a ``Conv1D``'s columns, a plain part a row range of a fused weight."""
    from smalti.llm.hf.family import Part

    experts = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    second = Part("experts.1.w1.weight", 1, 2, stacked=True)
    assert second.hf_shape(list(experts.shape)) == [3, 4]
    assert torch.equal(second.of(experts), experts[1])
    fused = torch.arange(6 * 2.0).reshape(6, 2)
    conv = Part("c_attn.weight", 2, 6, transposed=True)
    assert conv.hf_shape([6, 2]) == [2, 4] and torch.equal(conv.of(fused), fused[2:6].t())
    rows = Part("k_proj.weight", 2, 4)
    assert rows.hf_shape([6, 2]) == [2, 2] and torch.equal(rows.of(fused), fused[2:4])
