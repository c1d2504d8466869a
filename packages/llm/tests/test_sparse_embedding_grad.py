"""``model.sparse_embedding_grad``: inside smalti's trainer an untied token embedding gets a row-sparse gradient
(only the batch's rows), trains exactly like the dense one, and never holds a gradient the size of the table."""

from __future__ import annotations

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.data import build_dataloader
from smalti.llm import LLM
from smalti.llm.data.synthetic import MarkovTokens

VOCAB, STEPS = 512, 4


def _model(sparse: bool = True, tied: bool = False) -> LLM:
    torch.manual_seed(0)
    return LLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=16,
               norm_type="rmsnorm", ffn_type="glu", tie_embeddings=tied, sparse_embedding_grad=sparse)


class _Record(Callback):
    """The losses, and the token embedding's gradient (layout, bytes) when the optimizer step starts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[tuple[torch.layout, int]] = []

    def on_before_optimizer_step(self, state) -> None:
        grad = state.raw_model.wte.weight.grad
        values = grad.values() if grad.layout == torch.sparse_coo else grad
        self.grads.append((grad.layout, values.numel() * values.element_size()))

    def on_batch_end(self, state, logger) -> None:
        self.losses.append(float(state.batch_loss))


def _fit(model: LLM) -> tuple[LLM, _Record]:
    data = MarkovTokens(vocab_size=VOCAB, max_seq_len=16, num_samples=64, seed=1)
    record = _Record()
    trainer = Trainer(model, build_dataloader(data, 8, shuffle=False), f"{STEPS}ba",
                      optimizers=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
                      callbacks={"record": record}, eval_interval=None, loggers=[], progress_bar=False)
    trainer.fit()
    return model, record


def test_the_trainer_steps_a_row_sparse_embedding_gradient_like_the_dense_one():
    dense, dense_rec = _fit(_model(sparse=False))
    sparse, sparse_rec = _fit(_model(sparse=True))
    table_bytes = VOCAB * 32 * 4
    assert [layout for layout, _ in dense_rec.grads] == [torch.strided] * STEPS
    assert [layout for layout, _ in sparse_rec.grads] == [torch.sparse_coo] * STEPS
    assert all(size <= 8 * 16 * 32 * 4 < table_bytes for _, size in sparse_rec.grads)  # at most the batch's rows
    assert sparse_rec.losses == pytest.approx(dense_rec.losses, rel=1e-6, abs=0)
    for name, value in dense.state_dict().items():  # rows summed in another order: Adam may grow the ulps
        torch.testing.assert_close(sparse.state_dict()[name], value, rtol=1e-4, atol=1e-4, msg=name)


def test_dense_outside_the_trainer_and_for_a_tied_embedding():
    """A plain loop's ``optimizer.step()`` refuses sparse gradients: outside the trainer the gradient is dense;
    a tied embedding gets the head's dense gradient anyway, so it is dense in the trainer too."""
    model = _model(sparse=True)
    batch = next(iter(build_dataloader(MarkovTokens(vocab_size=VOCAB, max_seq_len=16, num_samples=8, seed=1), 8)))
    model.loss(model(batch), batch).backward()
    assert model.wte.weight.grad.layout == torch.strided
    torch.optim.AdamW(model.parameters(), fused=True).step()

    _, record = _fit(_model(sparse=True, tied=True))
    assert [layout for layout, _ in record.grads] == [torch.strided] * STEPS
