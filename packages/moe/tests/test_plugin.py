"""The core plugin surface: an import-light entry point, a config option Hydra can build, the bias callback."""

import subprocess
import sys
from importlib import metadata, resources
from types import SimpleNamespace

import torch
import yaml

from smalti.moe import MoE
from smalti.moe.balancing import AuxFreeBiasUpdate


def test_entry_point_loads_without_torch():
    code = ("import sys, importlib.metadata as m; "
            "ep = [e for e in m.entry_points(group='smalti') if e.name == 'moe'][0]; "
            "mod = ep.load(); print(mod.smalti_config_searchpath()); "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'plugin imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pkg://smalti.moe.conf"
    assert any(e.name == "moe" for e in metadata.entry_points(group="smalti"))


def test_bias_update_option_builds_the_callback():
    text = resources.files("smalti.moe.conf").joinpath("callbacks/moe_bias_update.yaml").read_text()
    spec = yaml.safe_load(text)["moe_bias_update"]
    module, _, name = spec["_target_"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls is AuxFreeBiasUpdate and cls(**{k: v for k, v in spec.items() if k != "_target_"}).coeff == 1e-3


def test_callback_updates_bias_after_optimizer_step_and_logs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=1,
                                    load_balancing="aux_free"))
    with torch.no_grad():
        model[0].router.gate.weight.zero_()
        model[0].router.gate.weight[2, 0] = 5.0  # everything to expert 2
    model(torch.randn(12, 8).abs())
    logged = []
    AuxFreeBiasUpdate(coeff=0.01).on_after_optimizer_step(
        state=SimpleNamespace(raw_model=model), logger=SimpleNamespace(log_metrics=lambda m: logged.append(m)))
    bias = model[0].router.expert_bias
    assert bias[2] < 0 and (bias[[0, 1, 3]] > 0).all()
    assert logged and logged[0]["moe/expert_bias_max_abs"] > 0
