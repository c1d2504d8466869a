"""``LLM.compile`` (what ``trainer.compile=true`` calls) compiles each block, not the whole forward: the blocks
share one compiled graph, train exactly as eager, and a second step does not recompile.

The ``aot_eager`` backend traces what Inductor would compile (dynamo's graphs and guards, AOTAutograd's backward)
in seconds; Inductor's own numerics are checked by ``bench/llm_vs_hf.py --compile`` (first-step loss to 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from smalti.llm import LLM


def _model(n_layers: int = 3) -> LLM:
    torch.manual_seed(0)
    return LLM(
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=n_layers,
        vocab_size=64,
        max_seq_len=16,
        norm_type="rmsnorm",
        ffn_type="glu",
        tie_embeddings=False,
    )


def _step(model: LLM, batch: dict[str, torch.Tensor]) -> float:
    loss = model.loss(model(batch), batch)
    loss.backward()
    return loss.item()


def _batches() -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))}
        for i in range(2)
    ]


def _graphs_after_each_step(n_layers: int) -> list[int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model(n_layers).train()
    model.compile(backend="aot_eager")
    graphs = []
    for batch in _batches():
        _step(model, batch)
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return graphs


def test_compile_trains_like_eager():
    eager, compiled = _model().train(), _model().train()
    compiled.compile(backend="aot_eager")
    assert all(block._compiled is compiled.blocks[0]._compiled for block in compiled.blocks)
    for batch in _batches():
        assert _step(compiled, batch) == pytest.approx(_step(eager, batch), rel=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_compile_shares_one_compilation_over_blocks_and_steps():
    """Three blocks compile the graphs of one, and the second step compiles nothing: a guard on a block's
    identity would recompile per block, one on the RoPE cache once the first call has filled it."""
    one, three = _graphs_after_each_step(1), _graphs_after_each_step(3)
    assert three[0] == one[0] > 0
    assert three[1] == three[0]


def test_compile_rejects_positional_arguments():
    with pytest.raises(TypeError, match="keyword"):
        _model().compile("inductor")
