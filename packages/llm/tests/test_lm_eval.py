"""A folder smalti-llm exports runs under lm-evaluation-harness (``--model hf``) offline, on a local task, and
its scores equal smalti's own ICL evaluation of the same task, example by example."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from smalti.llm import LLM  # noqa: E402
from smalti.llm.icl.evaluate import ContinuationScorer  # noqa: E402
from smalti.llm.tokenizer import load_tokenizer  # noqa: E402

TASK = Path(__file__).parent / "fixtures" / "lm_eval" / "smalti_lm_phrases.yaml"


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_lm_eval_scores_the_exported_folder_as_smalti_does(tmp_path, monkeypatch, position):
    import json

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from smalti.llm.export import save_model_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    tok = load_tokenizer("default")
    torch.manual_seed(0)
    shape = ({"position": "learned", "norm_type": "layernorm", "ffn_type": "mlp", "bias": False} if position == "learned"
             else {"position": "rope", "norm_type": "rmsnorm", "ffn_type": "glu", "n_kv_heads": 2})  # -> GPT-2 / Llama
    model = LLM(d_model=64, n_heads=4, n_layers=2, vocab_size=tok.vocab_size, max_seq_len=64, **shape,
                init_device="cpu").eval()
    folder = save_model_folder(model, tmp_path / "exported", tokenizer="default")

    data = Path(str(resources.files("smalti.llm") / "assets" / "icl" / "lm_phrases.jsonl"))
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:24]
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "task" / TASK.name).write_text(TASK.read_text().replace("DATA_FILE", str(tmp_path / "task" / "data.jsonl")))

    results = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=["smalti_lm_phrases"],
                              task_manager=TaskManager(include_path=str(tmp_path / "task")), num_fewshot=0,
                              batch_size=8, device="cpu", log_samples=True)
    samples = sorted(results["samples"]["smalti_lm_phrases"], key=lambda s: s["doc_id"])
    theirs = [(s["resps"][0][0][0], bool(s["resps"][0][0][1])) for s in samples]

    scorer = ContinuationScorer(model, tok.pad_id, 64, 8, torch.device("cpu"))
    with torch.no_grad():
        ours = scorer.score([(tok.encode(r["context"]), tok.encode(" " + r["continuation"])) for r in records])
    assert len(theirs) == len(ours) == len(records)
    for (loglik, greedy), (nll, _, correct) in zip(theirs, ours, strict=True):
        assert loglik == pytest.approx(-nll, abs=1e-3) and greedy == correct
    accuracy = sum(c for _, _, c in ours) / len(ours)
    assert results["results"]["smalti_lm_phrases"]["acc,none"] == pytest.approx(accuracy)
