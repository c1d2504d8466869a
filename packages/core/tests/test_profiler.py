"""profiler as a user reads it: one Chrome trace per rank and cycle under the run's traces folder, named in
metrics.jsonl, and a summary of the top operators across ranks."""

import io
import json

import pytest
import torch

from smalti.core import Trainer
from smalti.core.callbacks import Profiler
from smalti.core.callbacks.profiler import _events, profile_main, summarize
from smalti.core.cli.main import main
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, SmaltiError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


def fit(run_dir, profiler, loader=None, **kw):
    torch.manual_seed(0)
    path = run_dir / "metrics.jsonl"
    Trainer(MLPRegressor(), loader or build_dataloader(SyntheticRegression(256), 16), "8ba", eval_interval=None,
            callbacks={"profiler": profiler}, loggers={"jsonl": JSONLLogger(str(path), rank_zero_only=False)},
            **kw).fit()
    return path


def test_a_trace_per_cycle_under_the_run_folder_logged_as_artifact(tmp_path):
    profiler = Profiler(wait=1, warmup=1, active=2, repeat=2, trace_dir=str(tmp_path / "traces"))
    path = fit(tmp_path, profiler)
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == ["rank0.step4.trace.json", "rank0.step8.trace.json"]  # steps 3-4 and 7-8 recorded
    artifacts = [r["name"] for r in read_jsonl(path, kind="artifact")]
    assert artifacts == ["traces/rank0.step4.trace.json", "traces/rank0.step8.trace.json"]
    assert [r["metrics"]["profiler/traces"] for r in read_jsonl(path) if "profiler/traces" in r["metrics"]] == [1, 2]
    events = json.loads((tmp_path / "traces" / traces[0]).read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # two active steps, 0-based as torch counts them
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::addmm" for e in events)


def test_default_folder_is_outputs_run_traces_and_memory_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fit(tmp_path, Profiler(wait=0, warmup=1, active=1, profile_memory=True, gzip_traces=True), run_name="r1")
    (trace,) = (tmp_path / "outputs" / "r1" / "traces").iterdir()
    assert trace.name == "rank0.step2.trace.json.gz"
    rows = summarize(tmp_path / "outputs" / "r1")
    assert rows[0]["category"] == "cpu_op" and rows[0]["total_ms"] > 0
    events = _events(trace)
    assert any(e.get("name") == "[memory]" for e in events)  # allocations recorded


@pytest.mark.world_size(2)
def test_one_trace_per_rank_and_a_summary_across_ranks(shared_tmp_path):
    import torch.distributed as dist

    rank = dist.get_rank()
    loader = build_dataloader(SyntheticRegression(256), 16, dp_rank=rank, dp_world_size=2, seed=5)
    fit(shared_tmp_path / f"r{rank}", Profiler(wait=1, warmup=1, active=2, trace_dir=str(shared_tmp_path / "traces")),
        loader=loader)
    dist.barrier()
    if rank != 0:
        return
    names = sorted(p.name for p in (shared_tmp_path / "traces").iterdir())
    assert names == ["rank0.step4.trace.json", "rank1.step4.trace.json"]
    rows = summarize(shared_tmp_path)
    top = {r["name"]: r for r in rows}
    assert top["aten::addmm"]["ranks"] == 2
    # forward of 3 linears + backward's addmm-free matmuls: at least 3 calls a step, 2 steps, 2 ranks
    assert top["aten::addmm"]["calls"] >= 3 * 2 * 2
    out = io.StringIO()
    assert profile_main(["summary", str(shared_tmp_path), "--top", "5"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["total", "ms"] and len(lines) == 6


def test_summary_without_traces_says_how_to_get_them(tmp_path, capsys):
    with pytest.raises(SmaltiError, match=r"callbacks=\[profiler\]"):
        summarize(tmp_path)
    assert main(["profile", "summary", str(tmp_path)]) == 1
    assert "callbacks=[profiler]" in capsys.readouterr().err


@pytest.mark.parametrize(("kw", "key"), [({"active": 0}, "active"), ({"wait": -1}, "wait")])
def test_bad_schedule_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"callbacks\.profiler\.{key}"):
        Profiler(**kw)
