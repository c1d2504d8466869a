"""With the MLflow logger on, the trained model lands in a real MLflow server's model registry and reads back."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from smalti.llm import LLM

LLAMA = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=2048, max_seq_len=32, ffn_hidden_size=64,
             position="rope", norm_type="rmsnorm", ffn_type="glu", tie_embeddings=False)
MPT = dict(d_model=32, n_heads=4, n_layers=2, vocab_size=2048, max_seq_len=32, position="alibi",
           norm_type="low_precision_layernorm")


def _train(model: LLM, callbacks: dict, loggers: dict, run_name: str) -> None:
    from smalti.core import Trainer
    from smalti.llm.data.text import TokenizedText

    loader = torch.utils.data.DataLoader(TokenizedText(max_seq_len=32), batch_size=4, shuffle=False)
    Trainer(model, loader, "2ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks=callbacks,
            loggers=loggers, eval_interval=None, run_name=run_name).fit()


@pytest.mark.parametrize("shape", ["llama", "mpt"])
def test_trained_model_is_registered_and_reads_back(mlflow_server, tmp_path, shape, capsys):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from smalti.core.loggers import MLflowLogger
    from smalti.llm.export import load_model_folder
    from smalti.llm.mlflow_registry import MLflowModelRegistry

    torch.manual_seed(0)
    model = LLM(**(LLAMA if shape == "llama" else MPT))
    logger = MLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-llm-registry")
    registry = MLflowModelRegistry(registered_model_name=f"tiny-{shape}")
    _train(model, {"registry": registry}, {"mlflow": logger}, run_name=f"registry-{shape}")

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    versions = client.search_model_versions(f"name='tiny-{shape}'")
    assert [(v.version, v.run_id) for v in versions] == [("1", logger.run_id)]
    assert registry.registered == (f"tiny-{shape}", "1")
    folder = download_artifacts(artifact_uri=versions[0].source, dst_path=str(tmp_path / "download"),
                                tracking_uri=mlflow_server.tracking_uri)
    back = load_model_folder(folder)
    ids = torch.randint(0, 2048, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(back({"input_ids": ids})["logits"], model.eval()({"input_ids": ids})["logits"])
    files = {p.split("/")[-1] for p in (a.path for a in client.list_artifacts(logger.run_id, "model"))}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files  # MPT-shaped: transformers' MPT
    # The downloaded folder evaluates standalone, whichever layout it has.
    from smalti.llm.cli import main

    capsys.readouterr()
    assert main(["eval", "--model", folder, "--tasks", "default"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert "icl/mc_phrases/0shot/accuracy" in results and 0 <= results["icl/mc_phrases/0shot/accuracy"] <= 1
    # the registered folder is a Hugging Face one (LlamaForCausalLM, or MptForCausalLM for ALiBi)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if shape == "llama" else "MptForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, back({"input_ids": ids})["logits"], atol=1e-4, rtol=1e-4)


def test_without_the_mlflow_logger_nothing_is_registered():
    from smalti.llm.mlflow_registry import MLflowModelRegistry

    registry = MLflowModelRegistry()
    torch.manual_seed(0)
    _train(LLM(**MPT), {"registry": registry}, {}, run_name="no-mlflow")
    assert registry.registered is None


def test_hf_export_folder_is_what_gets_registered(mlflow_server, tmp_path, monkeypatch):
    """With ``hf_export`` in the run, the registry logs the folder it wrote (the source family's config and the
    source tokenizer files), exported once."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from smalti.core import Trainer
    from smalti.core.loggers import MLflowLogger
    from smalti.llm.hf import HFExport, PretrainedLLM
    from smalti.llm.mlflow_registry import MLflowModelRegistry
    from smalti.testing.hf_models import write_tiny_hf_model

    source = write_tiny_hf_model(tmp_path / "qwen2", "qwen2")
    model = PretrainedLLM(source, max_seq_len=32, init_device="cpu")
    logger = MLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-llm-registry")
    import smalti.llm.hf.callback as hf_export

    export = HFExport(folder=str(tmp_path / "hf"))
    calls = []
    original = hf_export.export_model
    monkeypatch.setattr(hf_export, "export_model", lambda *a, **k: calls.append(1) or original(*a, **k))
    # the registry first, so that it triggers the export that hf_export's own hook then finds done
    callbacks = {"registry": MLflowModelRegistry(registered_model_name="tiny-qwen2"), "hf_export": export}
    rows = [{"input_ids": torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(i))} for i in range(8)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    Trainer(model, loader, "2ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), callbacks=callbacks,
            loggers={"mlflow": logger}, eval_interval=None, run_name="registry-hf").fit()
    assert len(calls) == 1 and export.written == tmp_path / "hf"  # one export serves both
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    (version,) = client.search_model_versions("name='tiny-qwen2'")
    folder = download_artifacts(artifact_uri=version.source, dst_path=str(tmp_path / "download"),
                                tracking_uri=mlflow_server.tracking_uri)
    local = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    from pathlib import Path

    assert {p.name: p.read_bytes() for p in Path(folder).iterdir()} == local
    assert json.loads(local["config.json"])["model_type"] == "qwen2" and "tokenizer_config.json" in local


def test_every_nth_checkpoint_is_registered_as_a_version(mlflow_server, tmp_path):
    """interval=2 with a checkpoint every batch of a 4-batch run: versions at batches 2 and 4 (the final model, at
    4, is not registered twice); each reads back as the model it was at that step."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from smalti.checkpoint import Checkpointer
    from smalti.core import Callback, Trainer
    from smalti.core.loggers import MLflowLogger
    from smalti.llm.data.text import TokenizedText
    from smalti.llm.export import load_model_folder
    from smalti.llm.mlflow_registry import MLflowModelRegistry

    torch.manual_seed(0)
    model = LLM(**LLAMA)
    logger = MLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-llm-registry-interval")
    registry = MLflowModelRegistry(registered_model_name="tiny-steps", interval=2, tokenizer=None)
    loader = torch.utils.data.DataLoader(TokenizedText(max_seq_len=32), batch_size=4, shuffle=False)
    ids = torch.randint(0, 2048, (2, 16))
    logits = {}

    class Snapshot(Callback):  # the model's logits at each batch, to compare the registered versions with
        def on_batch_end(self, state):
            with torch.no_grad():
                logits[state.timestamp.batch] = state.raw_model.eval()({"input_ids": ids})["logits"]
            state.raw_model.train()

    Trainer(model, loader, "4ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-2), eval_interval=None,
            callbacks={"snapshot": Snapshot(), "checkpoint": Checkpointer(str(tmp_path / "ck"), save_interval="1ba"),
                       "registry": registry},
            loggers={"mlflow": logger}, run_name="registry-interval").fit()

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    versions = sorted(client.search_model_versions("name='tiny-steps'"), key=lambda v: int(v.version))
    assert [(v.version, v.tags.get("step")) for v in versions] == [("1", "2"), ("2", "4")]
    assert [v.source.rsplit("/", 1)[-1] for v in versions] == ["ep0-ba2", "ep0-ba4"]
    for version in versions:
        folder = download_artifacts(artifact_uri=version.source, dst_path=str(tmp_path / version.version),
                                    tracking_uri=mlflow_server.tracking_uri)
        with torch.no_grad():
            got = load_model_folder(folder)({"input_ids": ids})["logits"]
        torch.testing.assert_close(got, logits[int(version.tags["step"])])
