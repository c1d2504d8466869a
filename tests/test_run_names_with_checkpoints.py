"""Run names with smalti-checkpoint: each sweep point has its own checkpoint folder, and autoresume needs a
stable name (these need checkpoint=dcp, so they live here rather than in smalti-core's own tests)."""

import re

from smalti.testing.train_cli import smalti_train as train
from smalti.testing.train_cli import smalti_train_in_process

QUICK = ["model=mlp", "data=synthetic", "trainer.max_duration=3ba", "trainer.eval_interval=100ba", "callbacks=[]",
         "logger=[jsonl]"]
GENERATED = re.compile(r"^\d{8}-\d{6}-[a-z]+-[a-z]+$")


def losses(path):
    from smalti.core.loggers import read_jsonl

    return [r["metrics"]["loss/train/total"] for r in read_jsonl(path) if "loss/train/total" in r["metrics"]]


def test_sweep_points_get_their_own_names_and_checkpoint_folders(tmp_path):
    out = train(["-m", "checkpoint=dcp", "optimizer.lr=1e-3,3e-3", *QUICK], tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert GENERATED.match(sweep.name)
    for num in ("0", "1"):
        point = sweep / num
        assert (point / "checkpoints" / "ep0-ba3").is_dir(), sorted(point.rglob("*"))
        assert f"finished {sweep.name}-{num} " in (point / "rank0.log").read_text()
        assert len(losses(point / "metrics.jsonl")) == 3
    assert (tmp_path / "outputs" / "latest").resolve() == (sweep / "1").resolve()


def test_autoresume_without_a_stable_name_fails_saying_how_to_name_it(tmp_path, monkeypatch):
    code, err = smalti_train_in_process(QUICK + ["checkpoint=dcp", "checkpoint.autoresume=true"], tmp_path,
                                        monkeypatch)
    assert code not in (0, None), err
    assert "checkpoint.autoresume=true" in err and "run_name=<name>" in err
    assert "SMALTI_RUN_NAME" in err and "--rdzv-id" in err
    assert not list(tmp_path.glob("outputs/*/checkpoints/*"))
    named = train(QUICK + ["checkpoint=dcp", "checkpoint.autoresume=true"], tmp_path,
                  env={"SMALTI_RUN_NAME": "nightly"})
    assert named.returncode == 0, named.stderr[-3000:]
    assert (tmp_path / "outputs" / "nightly" / "checkpoints" / "ep0-ba3").is_dir()
