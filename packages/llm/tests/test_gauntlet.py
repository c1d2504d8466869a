"""The evaluation gauntlet: Foundry's scoring rules on known accuracies, its file format, and the callback in a
run logging category and composite scores at an interval given in tokens."""

from __future__ import annotations

import math

import pytest
import torch

from smalti.llm import LLM
from smalti.llm.data.text import TokenizedText
from smalti.llm.errors import ICLError
from smalti.llm.icl.gauntlet import Benchmark, Gauntlet, load_gauntlet

SPEC = {
    "eval_gauntlet": {
        "weighting": "EQUAL", "subtract_random_baseline": True, "rescale_accuracy": True,
        "averages": {"core_average": ["knowledge", "reasoning"], "knowledge_only": ["knowledge"]},
        "categories": [
            {"name": "knowledge", "benchmarks": [{"name": "qa", "num_fewshot": 3, "random_baseline": 0.0},
                                                 {"name": "facts", "num_fewshot": 0, "random_baseline": 0.25}]},
            {"name": "reasoning", "benchmarks": [{"name": "logic", "num_fewshot": 5, "random_baseline": 0.5}]},
        ],
    }
}
RESULTS = {"icl/qa/3shot/accuracy": 0.6, "icl/facts/0shot/accuracy": 0.55, "icl/logic/5shot/accuracy": 0.7,
           "icl/qa/0shot/accuracy": 0.99}
SIZES = {"qa": 1000, "facts": 16, "logic": 200}


def test_scores_follow_foundrys_rules():
    g = load_gauntlet(SPEC)
    facts = (0.55 - 0.25) / 0.75  # accuracy above chance over the room above chance
    logic = (0.7 - 0.5) / 0.5
    scores = g.scores(RESULTS, SIZES)
    assert scores["icl/gauntlet/knowledge"] == pytest.approx((0.6 + facts) / 2)
    assert scores["icl/gauntlet/reasoning"] == pytest.approx(logic)
    assert scores["icl/gauntlet/core_average"] == pytest.approx(((0.6 + facts) / 2 + logic) / 2)
    assert scores["icl/gauntlet/knowledge_only"] == pytest.approx((0.6 + facts) / 2)
    # weighting by examples and by their log2 (at least 1)
    by_size = Gauntlet(g.categories, weighting="SAMPLE_SZ", averages=g.averages).scores(RESULTS, SIZES)
    assert by_size["icl/gauntlet/knowledge"] == pytest.approx((1000 * 0.6 + 16 * facts) / 1016)
    by_log = Gauntlet(g.categories, weighting="LOG_SAMPLE_SZ").scores(RESULTS, SIZES)
    w_qa, w_facts = math.log2(1000), 4.0
    assert by_log["icl/gauntlet/knowledge"] == pytest.approx((w_qa * 0.6 + w_facts * facts) / (w_qa + w_facts))
    assert set(by_log) == {"icl/gauntlet/knowledge", "icl/gauntlet/reasoning", "icl/gauntlet/default_average"}
    # raw accuracies when the baseline is not subtracted
    raw = Gauntlet(g.categories, subtract_random_baseline=False, rescale_accuracy=False).scores(RESULTS, SIZES)
    assert raw["icl/gauntlet/reasoning"] == pytest.approx(0.7)


def test_bad_gauntlets_are_named(tmp_path):
    cats = {"k": [Benchmark("qa", 3, 0.0)]}
    with pytest.raises(ICLError, match="weighting='SIZE'"):
        Gauntlet(cats, weighting="SIZE")
    with pytest.raises(ICLError, match="rescale_accuracy=true needs subtract_random_baseline"):
        Gauntlet(cats, subtract_random_baseline=False, rescale_accuracy=True)
    with pytest.raises(ICLError, match="average 'k' has the name of a category"):
        Gauntlet(cats, averages={"k": ["k"]})
    with pytest.raises(ICLError, match="benchmark 'qa' at 3 shots has no ICL task"):
        Gauntlet(cats).check_tasks({"qa": [0, 1]})
    bad = tmp_path / "g.yaml"
    bad.write_text("eval_gauntlet:\n  categories:\n    - name: k\n      benchmarks:\n        - {name: qa, num_fewshot: 3}\n")
    with pytest.raises(ICLError, match=rf"{bad}: category 'k': each benchmark needs .*random_baseline"):
        load_gauntlet(str(bad))


def test_the_gauntlet_callback_logs_categories_at_a_token_interval():
    from smalti.core import Trainer
    from smalti.core.data import build_dataloader
    from smalti.llm.icl.callback import GauntletEval
    from smalti.testing import MetricsRecorder

    torch.manual_seed(0)
    model = LLM(d_model=32, n_heads=2, n_layers=1, vocab_size=2048, max_seq_len=64)
    tasks = [{"label": "mc", "dataset_uri": "smalti-llm:mc_phrases.jsonl", "icl_task_type": "multiple_choice",
              "num_fewshot": [0], "max_examples": 8},
             {"label": "schema", "dataset_uri": "smalti-llm:schema_phrases.jsonl", "icl_task_type": "schema",
              "max_examples": 6}]
    spec = {"categories": [{"name": "choice", "benchmarks": [{"name": "mc", "num_fewshot": 0, "random_baseline": 0.25},
                                                             {"name": "schema", "num_fewshot": 0,
                                                              "random_baseline": 0.5}]}]}
    gauntlet = GauntletEval(spec, tasks=tasks, interval="512tok", at_fit_end=True)  # 4 x 64 tokens a batch
    sink = MetricsRecorder()
    trainer = Trainer(model, build_dataloader(TokenizedText(max_seq_len=64), 4), "5ba",
                      optimizers=lambda p: torch.optim.AdamW(p, lr=1e-3), eval_interval=None,
                      callbacks={"gauntlet": gauntlet}, loggers={"sink": sink})
    trainer.fit()
    trainer.close()
    assert sink.steps("icl/gauntlet/choice") == [2, 4, 5], sink.rows  # every 512 tokens, then at fit end
    mc, schema = sink.values("icl/mc/0shot/accuracy")[-1], sink.values("icl/schema/0shot/accuracy")[-1]
    expected = ((mc - 0.25) / 0.75 + (schema - 0.5) / 0.5) / 2
    assert sink.values("icl/gauntlet/choice")[-1] == pytest.approx(expected)
    assert sink.values("icl/gauntlet/default_average")[-1] == pytest.approx(expected)


def test_the_shipped_gauntlet_names_the_shipped_tasks():
    from smalti.llm.icl import load_tasks

    g = load_gauntlet("default")
    g.check_tasks({t.label: list(t.num_fewshot) for t in load_tasks("default")})
    assert set(g.averages) == {"core_average"}
