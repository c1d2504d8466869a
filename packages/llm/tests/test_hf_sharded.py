"""``model=hf`` under FSDP2 on two gloo ranks: each rank reads only its rows of every weight into the shards of a
meta-built model (no full copy), and the export gathers one tensor at a time into a folder ``transformers``
loads with equal logits, sharded into several files above ``max_shard_size``."""

from __future__ import annotations

import json

import pytest
import torch


class _CountingSlices:
    """Wraps safetensors' ``safe_open`` and counts the elements each rank reads through ``get_slice``."""

    read = 0

    def __init__(self, real):
        self.real = real

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)
        counter = self

        class Handle:
            def __enter__(self):
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, name):
                piece = self.inner.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return piece.get_shape()

                    def __getitem__(self, index):
                        out = piece[index]
                        counter.read += out.numel()
                        return out

                return Slice()

        return Handle()


#: family -> (tiny model overrides, architecture): rows that split unevenly over the two ranks
CASES = {
    # one KV head and an odd FFN width: the fused q/k/v rows and the FFN rows split unevenly over the ranks
    "qwen2": ({"num_key_value_heads": 1, "intermediate_size": 97}, "Qwen2ForCausalLM"),
    # three experts stored fused ([3 * 48, 64]): rank 0 reads two experts' rows of w1/v1/w2, rank 1 one
    "dbrx": ({"ffn_config": {"moe_num_experts": 3}}, "DbrxForCausalLM"),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("family", list(CASES))
def test_fsdp_meta_model_loads_its_shards_and_exports_whole(shared_tmp_path, monkeypatch, family):
    import safetensors
    import torch.distributed as dist
    import transformers

    from smalti.core.parallelism import FSDP
    from smalti.llm.hf import PretrainedLLM, export_model, import_hf
    from smalti.testing.hf_models import write_tiny_hf_model

    overrides, architecture = CASES[family]
    folder = shared_tmp_path / family
    if dist.get_rank() == 0:
        write_tiny_hf_model(folder, family, **overrides)
    dist.barrier()
    reference = import_hf(folder).eval()

    counting = _CountingSlices(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counting)
    model = PretrainedLLM(folder)
    FSDP().wrap(model, torch.device("cpu"), "fp32")
    model.to_empty(device="cpu")
    model.init_weights()
    monkeypatch.undo()
    total = sum(p.numel() for p in reference.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    assert local < 0.6 * total  # sharded...
    assert counting.read == local  # ...and each rank read exactly its own rows from the files
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[name], rtol=0, atol=0, msg=name)

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()({"input_ids": ids})["logits"]
        torch.testing.assert_close(ours, reference({"input_ids": ids})["logits"], rtol=1e-5, atol=1e-5)

    out = shared_tmp_path / "export"
    written = export_model(model, out, max_shard_size="40KB")
    dist.barrier()
    assert written == out
    if dist.get_rank() == 0:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 3 and all((out / f).is_file() for f in files)
        assert not (out / "model.safetensors").exists()
        assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        assert tok.eos_token == "<|im_end|>"
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=1e-4)
    dist.barrier()
