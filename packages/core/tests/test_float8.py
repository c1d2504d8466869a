"""precision=amp_fp8: the linear layers multiply in float8 (torchao's Float8Linear over ``torch._scaled_mm``,
whose CPU kernel runs here), the head and routers stay in bf16, and training follows the bf16 loss curve."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from smalti.core import Callback, ConfigError, Trainer
from smalti.core.algorithms import Float8Training
from smalti.core.data import build_dataloader
from smalti.core.examples import CharCorpus, TinyLM
from smalti.testing.pytest_plugin import IN_RANK_ENV


class CountFloat8GEMMs(TorchDispatchMode):
    """Counts the matrix multiplies run inside it whose operands are torchao's float8 tensors (which then run
    ``torch._scaled_mm`` on their float8 data and scales)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default) and any(
                t.__name__.startswith("Float8") for t in types):
            self.calls += 1
        return func(*args, **(kwargs or {}))


class Losses(Callback):
    """The training loss of every step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_batch_end(self, state) -> None:
        self.values.append(float(state.batch_loss))


def trainer(precision, steps, algorithms=None, seed=0, callbacks=None):
    torch.manual_seed(seed)
    loader = build_dataloader(CharCorpus(seq_len=32), 8, seed=1)
    return Trainer(TinyLM(d_model=32, n_heads=2, n_layers=2, max_seq_len=32), loader, f"{steps}ba",
                   precision=precision, optimizers=functools.partial(torch.optim.AdamW, lr=3e-3),
                   algorithms=algorithms, callbacks=callbacks, loggers=[], progress_bar=False)


def test_linear_layers_compute_in_float8_and_the_head_stays_in_bf16():
    t = trainer("amp_fp8", 1)
    model = t.state.raw_model
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["head"] == "Linear"
    converted = [n for n, k in kinds.items() if k == "Float8Linear"]
    assert len(converted) == len(kinds) - 1 >= 4, kinds
    with CountFloat8GEMMs() as counter:
        t.fit()
    # forward, input gradient and weight gradient of every converted layer: three float8 GEMMs each
    assert counter.calls == 3 * len(converted)


def test_bf16_runs_no_float8_gemm():
    t = trainer("amp_bf16", 1)
    with CountFloat8GEMMs() as counter:
        t.fit()
    assert counter.calls == 0


def test_the_fp8_loss_curve_follows_bf16_within_two_percent():
    curves = {}
    for precision in ("amp_bf16", "amp_fp8"):
        losses = Losses()
        trainer(precision, 50, seed=3, callbacks=[losses]).fit()
        curves[precision] = losses.values
    bf16, fp8 = (sum(c[-10:]) / 10 for c in (curves["amp_bf16"], curves["amp_fp8"]))
    assert curves["amp_fp8"][-1] < curves["amp_fp8"][0] * 0.8  # it trains
    assert abs(fp8 - bf16) / bf16 < 0.02, (bf16, fp8)


def test_recipe_and_skip_are_settings():
    algo = Float8Training(recipe="rowwise", skip=["head", "blocks.0.*"])
    t = trainer("amp_fp8", 1, algorithms=[algo])
    assert all(not n.startswith("blocks.0.") for n in algo.converted) and algo.converted
    with pytest.raises(ConfigError, match="recipe='colwise' must be one of tensorwise, rowwise"):
        Float8Training(recipe="colwise")
    assert t.state.precision == "amp_fp8"


def test_float8_needs_the_fp8_precision_and_torchao(monkeypatch):
    with pytest.raises(ConfigError, match="needs trainer.precision=amp_fp8"):
        trainer("amp_bf16", 1, algorithms=[Float8Training()])
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"pip install 'smalti-core\[fp8\]'"):
        trainer("amp_fp8", 1)


def test_a_model_with_no_layer_to_convert_is_refused():
    with pytest.raises(ConfigError, match="found no linear layer to run in float8"):
        trainer("amp_fp8", 1, algorithms=[Float8Training(skip=["*"])])



def fp8_losses(world: int, output_dir):
    """8 steps of the fp8 TinyLM at a global batch of 8, split over ``world`` ranks under FSDP2 (or one process)."""
    from smalti.core.parallelism import FSDP

    losses = Losses()
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    loader = build_dataloader(CharCorpus(seq_len=32), 8 // world, dp_rank=rank, dp_world_size=world, seed=1)
    t = Trainer(TinyLM(d_model=32, n_heads=2, n_layers=2, max_seq_len=32), loader, "8ba", precision="amp_fp8",
                optimizers=functools.partial(torch.optim.AdamW, lr=3e-3), callbacks=[losses], loggers=[],
                progress_bar=False, parallelism=FSDP() if world > 1 else None, output_dir=str(output_dir))
    t.fit()
    return losses.values, t


@pytest.fixture
def one_process_losses(shared_tmp_path, tmp_path_factory):
    """The single-process fp8 losses, trained in the launching process and handed to the ranks in a file."""
    path = shared_tmp_path / "single.json"
    if not os.environ.get(IN_RANK_ENV):
        path.write_text(json.dumps(fp8_losses(1, tmp_path_factory.mktemp("single"))[0]))
    return json.loads(path.read_text())


@pytest.mark.world_size(2)
def test_fsdp2_all_gathers_float8_weights_and_follows_one_process(one_process_losses, shared_tmp_path):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    losses, t = fp8_losses(2, shared_tmp_path / f"rank{dist.get_rank()}")
    weights = [p for n, p in t.state.model.named_parameters() if n.endswith("qkv.weight")]
    assert weights and all(isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor) for p in weights)
    # Each rank scales its own half of the batch's activations: the curves agree to fp8's rounding, not bits.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process_losses), rtol=2e-2, atol=0)
