"""Row-sparse embedding gradients (``smalti.core.optim.row_sparse``): the same update as a dense gradient, without
a dense gradient the size of the table."""

import functools

import pytest
import torch
import torch.nn.functional as F

from smalti.core import Callback, Trainer
from smalti.core.algorithms import GradientClipping
from smalti.core.callbacks import OptimizerMonitor
from smalti.core.data import build_dataloader
from smalti.core.examples import CharCorpus, TinyLM
from smalti.core.optim import DecoupledAdamW, row_sparse

VOCAB, WIDTH = 300, 48

OPTIMIZERS = {
    "adamw_fused": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach_amsgrad": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True,
                                               amsgrad=True),
    "adam_single_l2": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.1, foreach=False),
    "decoupled_adamw": functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-3, fused=True),
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),  # made dense, then its own step
}


def _steps(sparse, make_optimizer, ids_per_step, clip=None):
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH))
    head = torch.nn.Parameter(torch.randn(WIDTH, 5))
    optimizer = make_optimizer([table, head])
    norms = []
    for ids in ids_per_step:
        optimizer.zero_grad(set_to_none=True)
        (F.embedding(ids, table, sparse=sparse) @ head).pow(2).mean().backward()
        assert (table.grad.layout == torch.sparse_coo) == sparse
        row_sparse.settle_sparse_grads([table, head])
        if clip == "norm":
            norms.append(row_sparse.clip_grad_norm([table, head], 0.5))
        elif clip == "value":
            row_sparse.clip_grad_value([table, head], 1e-3)
        row_sparse.step_sparse_params(optimizer)
        optimizer.step()
    return table.detach(), head.detach(), norms, optimizer.state_dict()["state"]


def _distinct_ids(steps=3):
    generator = torch.Generator().manual_seed(1)
    return [torch.randperm(VOCAB, generator=generator)[:64].reshape(4, 16) for _ in range(steps)]


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_update_equals_the_dense_one_bit_for_bit(name, clip, monkeypatch):
    """With no token repeated (so no sum of rows in another order) weights, norms and optimizer state equal the
    dense gradient's exactly, with the table stepped in blocks of 7 rows (and the state checkpointed as usual)."""
    ids = _distinct_ids()
    dense = _steps(False, OPTIMIZERS[name], ids, clip)
    monkeypatch.setattr(row_sparse, "BLOCK_BYTES", 7 * WIDTH * 4)
    sparse = _steps(True, OPTIMIZERS[name], ids, clip)
    assert torch.equal(sparse[0], dense[0]) and torch.equal(sparse[1], dense[1])
    assert [n.item() for n in sparse[2]] == [n.item() for n in dense[2]]
    assert sparse[3].keys() == dense[3].keys()
    for index, state in dense[3].items():
        assert state.keys() == sparse[3][index].keys()
        for key, value in state.items():
            other = sparse[3][index][key]
            assert other.dtype == value.dtype and other.device == value.device and torch.equal(other, value), key


def test_repeated_tokens_are_summed_once_and_agree_with_dense_to_rounding():
    generator = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 20, (4, 32), generator=generator) for _ in range(3)]  # many repeats
    dense = _steps(False, OPTIMIZERS["adamw_fused"], ids, "norm")
    sparse = _steps(True, OPTIMIZERS["adamw_fused"], ids, "norm")
    torch.testing.assert_close(sparse[0], dense[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack(sparse[2]), torch.stack(dense[2]), rtol=1e-6, atol=0)


def test_a_gradient_left_uncoalesced_is_still_stepped_right():
    """``step_sparse_params`` sums repeated rows itself when nothing settled the gradient first."""
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH))
    expected = table.detach().clone()
    ids = torch.tensor([[3, 3, 5, 3]])
    F.embedding(ids, table, sparse=True).sum().backward()
    assert not table.grad.is_coalesced()
    reference = torch.nn.Parameter(expected)
    reference.grad = table.grad.to_dense()
    torch.optim.AdamW([reference], lr=0.1).step()
    optimizer = torch.optim.AdamW([table], lr=0.1)
    row_sparse.step_sparse_params(optimizer)
    assert table.grad is None
    optimizer.step()  # nothing left for it
    assert torch.equal(table.detach(), reference.detach())


class _Layouts(Callback):
    """The embedding gradient's layout when the optimizer step starts, and the losses."""

    def __init__(self):
        self.layouts, self.losses = [], []

    def on_before_optimizer_step(self, state):
        grad = state.raw_model.embed.weight.grad  # None when the step ran in backward
        self.layouts.append(None if grad is None else grad.layout)

    def on_after_train_batch(self, state):
        self.losses.append(state.batch_loss.item())


class _SparseEmbeddingLM(TinyLM):
    """TinyLM whose token embedding asks for a row-sparse gradient where the trainer takes one, as smalti-llm's
    LLM does."""

    def forward(self, batch):
        self.embed.sparse = self.sparse_embedding and row_sparse.sparse_grads_accepted()
        if self.embed.sparse:
            row_sparse.note_sparse_grad(self.embed.weight)
        return super().forward(batch)


def _fit(sparse, clip=True, **kwargs):
    torch.manual_seed(0)
    model = _SparseEmbeddingLM(d_model=32, n_heads=2, n_layers=2, max_seq_len=32)
    model.sparse_embedding = sparse
    record = _Layouts()
    trainer = Trainer(model, build_dataloader(CharCorpus(seq_len=32), 8, seed=1), "5ba",
                      optimizers=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
                      eval_interval=None, loggers=[], progress_bar=False,
                      algorithms=[GradientClipping(clipping_threshold=0.05)] if clip else [],
                      callbacks={"record": record, **({"monitor": OptimizerMonitor()} if clip else {})}, **kwargs)
    trainer.fit()
    return trainer, record


# the step in backward refuses accumulation over microbatches, and clipping (it needs every gradient at once)
@pytest.mark.parametrize(("microbatch", "in_backward"), [(None, False), (4, False), (None, True)],
                         ids=["step", "microbatches", "in_backward"])
def test_the_trainer_clips_monitors_and_steps_a_row_sparse_embedding_like_a_dense_one(microbatch, in_backward):
    kwargs = {"device_train_microbatch_size": microbatch} if microbatch else {}
    if in_backward:
        kwargs["optimizer_in_backward"] = True
    dense, dense_rec = _fit(False, clip=not in_backward, **kwargs)
    sparse, sparse_rec = _fit(True, clip=not in_backward, **kwargs)
    if not in_backward:
        assert dense_rec.layouts == [torch.strided] * 5
        assert sparse_rec.layouts == [torch.sparse_coo] * 5  # never made dense on the way
    assert sparse_rec.losses == pytest.approx(dense_rec.losses, rel=1e-6, abs=0)
    # repeated tokens' rows are summed in another order (ulps), which Adam's normalised step can grow on
    # near-zero gradients over the steps: the key bias's gradient is rounding noise (softmax ignores it), and
    # without clipping Adam moves it by up to ~lr
    for (name, a), b in zip(dense.state.raw_model.state_dict().items(),
                            sparse.state.raw_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 if not in_backward else 1e-3, msg=name)
