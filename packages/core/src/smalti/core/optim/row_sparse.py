"""Row-sparse gradients: an embedding's gradient kept as the rows a batch touched, never as a dense matrix.

A token embedding's gradient is zero outside the rows of the tokens a batch holds, yet a dense gradient is the
size of the whole table (at vocabulary 128,256 and width 4,096, 2.1 GB in fp32), alive at the end of backward
next to every other gradient and the optimizer state. ``F.embedding(..., sparse=True)`` makes that gradient a
sparse COO tensor of only the rows used; this module lets the rest of a step take it:

* :func:`begin_sparse_grads` / :func:`end_sparse_grads` are the trainer's
  promise that it takes them: a model gives a row-sparse gradient only inside that scope
  (:func:`sparse_grads_accepted`) and notes the parameter (:func:`note_sparse_grad`), so a plain training loop
  keeps dense gradients and the trainer looks only at the noted parameters;
* :func:`settle_sparse_grads` (the trainer, after the last microbatch's backward) sums the repeated rows once
  (``coalesce``); under a gradient scaler the trainer opens no scope, so the gradients stay dense;
* :func:`grad_norm` and :func:`clip_grad_norm` are ``torch.nn.utils``' global L2 norm and clipping over dense
  and row-sparse gradients together (the sparse ones count their stored rows: the others are zero);
* :func:`step_sparse_params` steps the parameters with a row-sparse gradient before ``optimizer.step()`` steps
  the rest: for ``torch.optim.Adam``/``AdamW`` (and smalti's ``DecoupledAdamW``) with the optimizer's own functional update (its ``fused`` or
  ``foreach`` choice, hyperparameters and state), block of rows by block of rows, the gradient made dense one
  block at a time; the state is the optimizer's own, so checkpoints do not change. Any other optimizer gets the
  gradient dense (correct, without the saving).

Adam's step moves every row, not only the touched ones (the moments decay and weight decay applies), so each
block is stepped with the zeros of its untouched rows: the update equals the dense one element by element.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch.optim.adam import adam as adam_update  # the functional update Adam and AdamW step with

from smalti.core.optim.decoupled import DECAY_KEY, DecoupledAdamW

#: Bytes of a dense gradient block made at a time in :func:`step_sparse_params`.
BLOCK_BYTES = 16 * 2**20

_ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, DecoupledAdamW)
_scope = threading.local()  # .noted: the parameters given row-sparse gradients in this scope, or None


def begin_sparse_grads(enabled: bool = True) -> list[torch.Tensor] | None:
    """Open a scope in which models may give row-sparse gradients (the trainer's forward and backward, which
    settles, clips and steps them): returns the list the models note those parameters in (:func:`note_sparse_grad`),
    or None when ``enabled`` is false. Close it with :func:`end_sparse_grads`. Two calls a step, so a step
    without sparse gradients pays nothing else (``packages/core/tests/test_overhead_calls.py``)."""
    _scope.noted = [] if enabled else None
    return _scope.noted


def end_sparse_grads() -> None:
    """Close the scope :func:`begin_sparse_grads` opened: models give dense gradients again."""
    _scope.noted = None


def sparse_grads_accepted() -> bool:
    """Whether the running code takes row-sparse gradients (see :func:`begin_sparse_grads`)."""
    return getattr(_scope, "noted", None) is not None


def note_sparse_grad(param: torch.Tensor) -> None:
    """Tell the trainer that ``param`` gets a row-sparse gradient in this scope (a model calls this in forward,
    where it asks for one); the trainer settles and steps only the noted parameters."""
    noted = getattr(_scope, "noted", None)
    if noted is not None and not any(p is param for p in noted):
        noted.append(param)


def has_sparse_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is a sparse COO tensor."""
    return param.grad is not None and param.grad.layout == torch.sparse_coo


def sparse_grad_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``params`` whose gradient is row-sparse."""
    return [p for p in params if p.grad is not None and p.grad.layout == torch.sparse_coo]


def densify_grads(params: Iterable[torch.Tensor]) -> None:
    """Make every row-sparse gradient of ``params`` dense (for code that reads gradients as dense tensors)."""
    for p in sparse_grad_params(params):
        p.grad = p.grad.to_dense()


def settle_sparse_grads(params: Iterable[torch.Tensor]) -> None:
    """Sum the repeated rows of each row-sparse gradient once (``coalesce``)."""
    for p in sparse_grad_params(params):
        p.grad = p.grad.coalesce()


def _split(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters of ``params`` with a gradient: those whose gradient is dense, and the row-sparse ones."""
    dense, sparse = [], []
    for p in params:
        if p.grad is not None:
            (sparse if p.grad.layout == torch.sparse_coo else dense).append(p)
    return dense, sparse


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params``, dense and row-sparse together (a sparse gradient counts
    its stored rows once repeated ones are summed)."""
    dense, sparse = _split(params)
    return torch.nn.utils.get_total_norm([p.grad for p in dense] + [p.grad.coalesce().values() for p in sparse])


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over dense and row-sparse gradients; returns the norm before clipping."""
    dense, sparse = _split(params)
    total = grad_norm(dense + sparse)
    if dense:
        torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s coefficient
    for p in sparse:
        g = p.grad.coalesce()
        p.grad = torch.sparse_coo_tensor(g.indices(), g.values() * scale.to(g.dtype), g.shape,
                                         is_coalesced=True, check_invariants=False)
    return total


def clip_grad_value(params: Iterable[torch.Tensor], clip_value: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` over dense and row-sparse gradients."""
    dense, sparse = _split(params)
    if dense:
        torch.nn.utils.clip_grad_value_(dense, clip_value)
    for p in sparse:
        g = p.grad.coalesce()
        p.grad = torch.sparse_coo_tensor(g.indices(), g.values().clamp(-clip_value, clip_value), g.shape,
                                         is_coalesced=True, check_invariants=False)


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> dict:
    """``p``'s Adam state, made as ``torch.optim.Adam`` makes it at a parameter's first step."""
    state = optimizer.state[p]
    if not state:
        on_device = bool(group.get("fused") or group.get("capturable"))
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def _adam_step_by_blocks(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> None:
    grad = p.grad.coalesce()
    state = _adam_state(optimizer, p, group)
    index, values = grad.indices()[0], grad.values()
    rows = p.shape[0]
    row_bytes = max(1, p[0].numel() * p.element_size())
    block = max(1, BLOCK_BYTES // row_bytes)
    step = state["step"]
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    if group.get(DECAY_KEY):  # DecoupledAdamW's decay, applied before its AdamW step as its own step does
        p.mul_(1 - group[DECAY_KEY] * group["lr"] / group["initial_lr"])
    stepped = step
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        lo, hi = torch.searchsorted(index, torch.tensor([start, stop], device=index.device)).tolist()
        dense = torch.zeros((stop - start, *p.shape[1:]), dtype=values.dtype, device=values.device)
        if hi > lo:
            dense.index_copy_(0, index[lo:hi] - start, values[lo:hi])
        stepped = step.clone()  # the functional update counts its own copy of the step, once per block
        adam_update(
            [p[start:stop]], [dense], [state["exp_avg"][start:stop]], [state["exp_avg_sq"][start:stop]],
            [state["max_exp_avg_sq"][start:stop]] if group["amsgrad"] else [], [stepped],
            foreach=group.get("foreach"), capturable=group.get("capturable", False),
            differentiable=group.get("differentiable", False), fused=group.get("fused"),
            decoupled_weight_decay=decoupled, amsgrad=group["amsgrad"], beta1=group["betas"][0],
            beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group.get("maximize", False),
        )
    step.copy_(stepped)


def step_sparse_params(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> None:
    """Step every parameter of ``optimizer`` (of those in ``params``, if given) that has a row-sparse gradient
    and clear that gradient.

    ``torch.optim.Adam``, ``AdamW`` and :class:`~smalti.core.optim.DecoupledAdamW` (exactly those classes) are stepped block of rows by block of rows with
    their own functional update; any other optimizer gets the gradient made dense and steps it itself.
    """
    wanted = None if params is None else {id(p) for p in params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if (wanted is not None and id(p) not in wanted) or not has_sparse_grad(p):
                continue
            if type(optimizer) not in _ADAM_FAMILY or p.dim() < 1:
                p.grad = p.grad.to_dense()
                continue
            _adam_step_by_blocks(optimizer, p, group)
            p.grad = None
