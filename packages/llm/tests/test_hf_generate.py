"""``smalti-llm generate``: greedy decoding gives ``transformers``' ``generate(do_sample=False)`` tokens (plain and
chat prompts, across the sliding window of a Mistral model, through the experts of Mixtral and DBRX); top-p sampling is seeded and keeps the top token."""

from __future__ import annotations

import pytest
import torch
import transformers

from smalti.llm.cli import main
from smalti.llm.generate import eos_ids, generate_ids
from smalti.llm.hf import import_hf
from smalti.testing.hf_models import write_tiny_hf_model  # noqa: E402

PROMPT = "The old clockmaker mended a blue lantern by the river"
#: seeds of tiny models whose default one greedily repeats a couple of tokens (which would prove little)
SEEDS = {"mixtral": 1}


def _hf_generate(folder, ids: list[int], n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "dbrx"])
def test_greedy_generation_equals_transformers(tmp_path, monkeypatch, capsys, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from smalti.llm.hf_tokenizer import HFTokenizer

    folder = write_tiny_hf_model(tmp_path / family, family, seed=SEEDS.get(family, 0))
    tok = HFTokenizer.from_folder(folder)
    n = 24  # with the prompt, beyond Mistral's 16-position window
    for chat in (False, True):
        ids = (tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       tokenize=True) if chat else tok.encode(PROMPT, add_special_tokens=True))
        theirs = _hf_generate(folder, list(ids), n)
        ours = generate_ids(import_hf(folder), list(ids), n, eos_ids=eos_ids(folder, tok))
        assert ours == theirs, (family, chat)
        assert len(set(theirs)) > 3  # not a degenerate repeat of one token
        capsys.readouterr()
        argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(n)]
        assert main(argv + (["--chat"] if chat else [])) == 0
        assert capsys.readouterr().out == tok.decode(theirs) + "\n"


def test_top_p_sampling_is_seeded_and_keeps_the_most_likely_token(tmp_path):
    folder = write_tiny_hf_model(tmp_path, "llama")
    model = import_hf(folder)
    prompt = [0, 5, 9, 200, 31]
    greedy = generate_ids(model, prompt, 12)
    first = generate_ids(model, prompt, 12, temperature=1.0, top_p=0.9, seed=3)
    assert generate_ids(model, prompt, 12, temperature=1.0, top_p=0.9, seed=3) == first
    assert first != greedy  # sampling does sample
    assert generate_ids(model, prompt, 12, temperature=1.0, top_p=1e-6, seed=4) == greedy  # only the top token


def test_generate_refuses_a_hub_name(capsys):
    assert main(["generate", "--model", "mistralai/Mistral-7B-v0.1", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--model='mistralai/Mistral-7B-v0.1'" in err and "never downloads" in err
