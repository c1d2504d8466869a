"""smalti plan: the per-GPU state memory formulas, the roofline, plan options and the CLI (core's own model)."""

from __future__ import annotations

import pytest
import torch

from smalti.core.cli.main import main as smalti_main
from smalti.core.errors import ConfigError
from smalti.core.plan.estimate import (
    Layout,
    ParamCounts,
    collective_seconds,
    optimizer_states,
    roofline,
    state_memory,
)
from smalti.core.plan.hardware import ACCELERATORS, get_accelerator
from smalti.core.plan.report import count_parameters, make_plan, split_overrides

COUNTS = ParamCounts(total=8_000, linear=6_000, largest_unit=1_000, root=2_000, largest_tensor=500)


def memory(kind: str, world: int = 8, shard: int = 8, replicate: int = 1, n_micro: int = 1, **kw):
    layout = Layout(kind, world, 8, shard, replicate)
    args = dict(master_bytes=4, weight_bytes=4, reduce_bytes=4, amp=False, compute_bytes=4, optimizer_state_tensors=2)
    args.update(kw)
    return state_memory(COUNTS, layout, num_microbatches=n_micro, **args)


def test_fsdp_shards_parameters_gradients_and_adam_state_over_the_world() -> None:
    s = memory("fsdp")
    assert s.persistent == {"parameters": 4_000, "gradients": 4_000, "optimizer state": 8_000}


def test_hsdp_shards_only_within_its_shard_group() -> None:
    s = memory("hsdp", world=16, shard=8, replicate=2)
    assert s.persistent["parameters"] == 8_000 * 4 / 8


def test_ddp_holds_everything_plus_gradient_buckets() -> None:
    s = memory("ddp", shard=1, replicate=8)
    assert s.persistent == {
        "parameters": 32_000, "gradients": 32_000, "optimizer state": 64_000, "ddp gradient buckets": 32_000
    }


def test_fsdp_gradient_accumulation_keeps_unsharded_gradients_only_when_reducing_once_per_step() -> None:
    assert "unsharded accumulated gradients" not in memory("fsdp", n_micro=1).forward_backward
    # The default: each micro batch reduce-scattered into the sharded gradients (torchtitan's way).
    assert "unsharded accumulated gradients" not in memory("fsdp", n_micro=4).forward_backward
    layout = Layout("fsdp", 8, 8, 8, 1, reduce_every_microbatch=False)
    s = state_memory(COUNTS, layout, master_bytes=4, weight_bytes=2, reduce_bytes=4, amp=False, compute_bytes=2,
                     optimizer_state_tensors=2, num_microbatches=4)
    assert s.forward_backward["unsharded accumulated gradients"] == 8_000 * 4


def test_fsdp_gathers_the_root_and_two_blocks_in_the_forward_dtype() -> None:
    s = memory("fsdp", weight_bytes=2)
    assert s.forward_backward["gathered parameters"] == (2_000 + 2 * 1_000) * 2


def test_autocast_keeps_half_copies_of_fp32_linear_weights() -> None:
    s = memory("single", world=1, shard=1, amp=True, compute_bytes=2)
    assert s.forward_backward["autocast weight copies"] == 6_000 * 2
    assert "autocast weight copies" not in memory("fsdp", amp=True, compute_bytes=2, weight_bytes=2).forward_backward


def test_optimizer_state_tensors_by_class() -> None:
    assert optimizer_states("torch.optim.AdamW") == 2
    assert optimizer_states("smalti.core.optim.DecoupledAdamW") == 2
    assert optimizer_states("torch.optim.SGD", momentum=0.9) == 1
    assert optimizer_states("torch.optim.SGD", momentum=0.0) == 0


def test_fsdp_collectives_gather_twice_and_reduce_once_per_micro_batch_or_per_step() -> None:
    gpu = ACCELERATORS["h100"]
    layout = Layout("fsdp", 8, 8, 8, 1)
    one = collective_seconds(COUNTS, layout, gpu, 2, 4, num_microbatches=1)
    ring = 7 / 8
    expected = ((8_000 - 2_000) * 2 * 2 + 2_000 * 2 + 8_000 * 4) * ring / gpu.intra_node_bw
    assert one == pytest.approx(expected)
    across = collective_seconds(COUNTS, Layout("fsdp", 16, 8, 16, 1), gpu, 2, 4, num_microbatches=1)
    assert across > one * gpu.intra_node_bw / gpu.inter_node_bw * 0.9  # a 2-node ring runs at the NIC's speed
    reduce = 8_000 * 4 * ring / gpu.intra_node_bw
    four = collective_seconds(COUNTS, layout, gpu, 2, 4, num_microbatches=4)
    assert four == pytest.approx(4 * one)  # a reduce-scatter per micro batch
    once = Layout("fsdp", 8, 8, 8, 1, reduce_every_microbatch=False)
    assert collective_seconds(COUNTS, once, gpu, 2, 4, num_microbatches=4) == pytest.approx(4 * one - 3 * reduce)


def test_roofline_mfu_is_model_flops_over_peak_time() -> None:
    gpu = ACCELERATORS["h100"]
    counts = ParamCounts(total=1, linear=1, largest_unit=1, root=0, largest_tensor=1)
    flops = 1e15
    step = roofline(flops, flops, 4096, 2, 0.0, counts, Layout("single", 1, 1), gpu, "bf16", 0.5, 4)
    assert step.compute_s == pytest.approx(2 * flops / (0.5 * gpu.peak_flops["bf16"]))
    assert step.mfu == pytest.approx(0.5, rel=1e-3)
    assert step.tokens_per_s_per_gpu == pytest.approx(2 * 4096 / step.step_s)


def test_plan_options_are_typed_and_unknown_ones_are_named() -> None:
    options, rest = split_overrides(["model=tiny_lm", "plan.gpus=4", "plan.sequence_id=true"])
    assert options["gpus"] == 4 and options["sequence_id"] is True and rest == ["model=tiny_lm"]
    with pytest.raises(ConfigError, match=r"plan\.gpuz=8.*gpu, gpus, nodes"):
        split_overrides(["plan.gpuz=8"])
    with pytest.raises(ConfigError, match=r"plan\.gpus='many' must be a positive number"):
        split_overrides(["plan.gpus=many"])
    with pytest.raises(ConfigError, match=r"plan\.gpu='v100' is not one of h100, a100, h200, l4, cpu"):
        get_accelerator("v100")


def test_parameter_count_on_meta_equals_the_real_models() -> None:
    from smalti.core.examples import TinyLM

    real = TinyLM(vocab_size=256, d_model=64, n_heads=4, n_layers=3, max_seq_len=32)
    with torch.device("meta"):
        meta = TinyLM(vocab_size=256, d_model=64, n_heads=4, n_layers=3, max_seq_len=32)
    counts = count_parameters(meta)
    assert counts.total == sum(p.numel() for p in real.parameters())
    assert counts.root == sum(p.numel() for n, p in real.named_parameters() if not n.startswith("blocks."))


def test_plan_of_core_model_under_fsdp_divides_its_state_by_the_gpus() -> None:
    one = make_plan(["model=tiny_lm", "parallelism=fsdp", "plan.gpus=1"])
    eight = make_plan(["model=tiny_lm", "parallelism=fsdp", "plan.gpus=8"])
    assert eight.memory["parameters"] == pytest.approx(one.memory["parameters"] / 8)
    assert not eight.activations_known and "no installed plugin implements smalti_plan_model" in eight.notes[0]
    with pytest.raises(ConfigError, match="parallelism=single runs on one device"):
        make_plan(["model=tiny_lm", "plan.gpus=8"])


def test_cli_prints_the_plan_and_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert smalti_main(["plan", "model=tiny_lm", "parallelism=ddp", "plan.gpu=a100", "plan.gpus=2"]) == 0
    out = capsys.readouterr().out
    assert "2 A100 = 2 GPU(s)" in out and "ddp gradient buckets" in out and ": fits" in out
    assert smalti_main(["plan", "model=tiny_lm", "plan.gpu=tpu"]) == 2
    assert "plan.gpu='tpu' is not one of" in capsys.readouterr().err

