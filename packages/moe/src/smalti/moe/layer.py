"""The Mixture-of-Experts layer: route, sort by expert, expert FFNs as grouped GEMMs, weighted combine."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from smalti.moe import ops
from smalti.moe.errors import MoEError
from smalti.moe.losses import balance_statistics, expert_counts, load_balancing_loss, router_z_loss
from smalti.moe.reference import ACTIVATIONS
from smalti.moe.router import Router, Routing


class MoE(nn.Module):
    """A token-choice MoE FFN. ``forward(x) -> (y, aux_loss)`` for ``x [..., hidden_size]``.

    Arguments follow MegaBlocks' names without the ``moe_`` prefix:

    * ``ffn_hidden_size``: each expert's hidden width; ``mlp_type`` ``mlp`` (up, activation, down) or
      ``glu`` (``act(x W_gate) * x W_up``, SwiGLU with ``activation='silu'``); ``activation`` one of
      ``gelu`` (tanh), ``gelu_exact``, ``silu``, ``relu``.
    * Router: ``score_func`` ``softmax`` or ``sigmoid``; ``router_jitter`` eps multiplies the router's input
      by U(1-eps, 1+eps) in training (``jitter_experts``: the jittered input feeds the experts too, as in
      Mixtral); ``normalize_expert_weights`` p renormalises the kept weights by their
      p-norm (None keeps the raw scores).
    * ``capacity_factor`` 0 or None is dropless; above 0 each expert takes at most
      ``int(capacity_factor * top_k * T / num_experts)`` entries and later (token, slot) entries are dropped.
    * ``num_shared_experts``: experts every token uses, added to the routed output (one dense FFN of
      width ``num_shared_experts * ffn_hidden_size``). ``shared_expert_size``: instead, one shared expert of
      that width and of the layer's ``mlp_type`` (:class:`SharedExpert`), scaled per token by
      ``sigmoid(x w)`` when ``shared_expert_gate`` (Qwen2-MoE's shared expert).
    * ``load_balancing``: ``aux_loss`` (MegaBlocks' loss times ``lbl_weight``), ``aux_free`` (DeepSeek-V3:
      a selection bias updated from expert counts after each optimizer step, see
      :mod:`smalti.moe.balancing`) or ``none``. ``zloss_weight`` adds the router z-loss.
      ``lbl_scope``: ``layer`` (each layer's own loss, as above) or ``model`` (Hugging Face's
      ``load_balancing_loss_func``: shares and probabilities pooled over all layers before their product; the
      layer then returns its :func:`~smalti.moe.losses.balance_statistics` in place of a loss, and the model
      sums them and calls :func:`~smalti.moe.losses.pooled_load_balancing_loss`).
    * ``backend``: ``torch`` (reference kernels, any device) or ``triton`` (CUDA, or Triton's CPU
      interpreter with ``TRITON_INTERPRET=1``); choosing ``triton`` where it cannot run raises
      :class:`MoEError` saying why.

    ``aux_loss`` returned is this layer's balancing loss plus its z-loss, both in training only;
    ``num_layers`` (the model's MoE layer count) scales the balancing loss as MegaBlocks does, so the sum
    over layers is its batched loss. Nothing is kept in module-global state; the last step's parts are in
    :attr:`last_losses` (detached) for logging.

    ``expert_group``: a process group, or a ``DeviceMesh`` whose ``ep_mesh_dim`` dimension is used, over
    which the experts are split (expert parallelism); each rank then holds ``num_experts / group size``
    of them (``w1``/``w2`` hold only the local experts) and tokens travel by all-to-all. Under expert
    parallelism, capacity dropping applies to each rank's own tokens.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int = 8,
        top_k: int = 2,
        mlp_type: str = "mlp",
        activation: str = "gelu",
        capacity_factor: float | None = None,
        num_shared_experts: int = 0,
        shared_expert_size: int = 0,
        shared_expert_gate: bool = False,
        router_jitter: float = 0.0,
        jitter_experts: bool = False,
        normalize_expert_weights: float | None = None,
        score_func: str = "softmax",
        load_balancing: str = "aux_loss",
        lbl_weight: float = 0.1,
        zloss_weight: float = 0.0,
        lbl_scope: str = "layer",
        backend: str = "torch",
        num_layers: int = 1,
        expert_group: Any = None,
        ep_mesh_dim: str = "ep",
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if mlp_type not in ("mlp", "glu"):
            raise MoEError(f"mlp_type={mlp_type!r} must be 'mlp' or 'glu'")
        if activation not in ACTIVATIONS:
            raise MoEError(f"activation={activation!r} must be one of {', '.join(ACTIVATIONS)}")
        if load_balancing not in ("aux_loss", "aux_free", "none"):
            raise MoEError(f"load_balancing={load_balancing!r} must be 'aux_loss', 'aux_free' or 'none'")
        if lbl_scope not in ("layer", "model"):
            raise MoEError(f"lbl_scope={lbl_scope!r} must be 'layer' or 'model'")
        if lbl_scope == "model" and zloss_weight:
            raise MoEError("lbl_scope='model' returns balance statistics, not a loss: set zloss_weight=0")
        if shared_expert_size and num_shared_experts:
            raise MoEError(f"num_shared_experts={num_shared_experts} and shared_expert_size={shared_expert_size} "
                           "both describe the shared experts: give one")
        if shared_expert_gate and not shared_expert_size:
            raise MoEError("shared_expert_gate=True gates the shared expert of shared_expert_size, which is 0")
        if capacity_factor is not None and capacity_factor < 0:
            raise MoEError(f"capacity_factor={capacity_factor} must be >= 0 (0 or None: dropless)")
        if num_layers < 1:
            raise MoEError(f"num_layers={num_layers} must be the model's number of MoE layers (>= 1)")
        if backend not in ops.BACKENDS:
            raise MoEError(f"backend={backend!r} is not one of {', '.join(ops.BACKENDS)}")
        if backend == "triton":
            reason = ops.triton_unavailable_reason(torch.device(device) if device is not None else None)
            if reason:
                raise MoEError(f"backend='triton' cannot run: {reason}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.mlp_type, self.activation = mlp_type, activation
        self.capacity_factor = capacity_factor or 0.0
        self.load_balancing, self.lbl_weight, self.zloss_weight = load_balancing, lbl_weight, zloss_weight
        self.lbl_scope, self.jitter_experts = lbl_scope, jitter_experts
        self.backend = backend
        self.num_layers = num_layers
        self.expert_group = _resolve_group(expert_group, ep_mesh_dim)
        expert_group = self.expert_group
        ep = _group_size(expert_group)
        if num_experts % ep:
            raise MoEError(f"num_experts={num_experts} does not divide over {ep} expert-parallel ranks")
        self.num_local_experts = num_experts // ep
        self.router = Router(hidden_size, num_experts, top_k, score_func, router_jitter, normalize_expert_weights,
                             use_bias=load_balancing == "aux_free", device=device, dtype=dtype)
        factory = {"device": device, "dtype": dtype}
        up_width = 2 * ffn_hidden_size if mlp_type == "glu" else ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, up_width, **factory))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, ffn_hidden_size, hidden_size, **factory))
        self.shared = (
            nn.Sequential(nn.Linear(hidden_size, ffn_hidden_size * num_shared_experts, bias=False, **factory),
                          _Activation(activation),
                          nn.Linear(ffn_hidden_size * num_shared_experts, hidden_size, bias=False, **factory))
            if num_shared_experts else None
        )
        self.shared_expert = (
            SharedExpert(hidden_size, shared_expert_size, mlp_type, activation, shared_expert_gate, **factory)
            if shared_expert_size else None
        )
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device), persistent=False)
        self.init_std = init_std
        self.last_losses: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) experts; the output projection scaled down by sqrt(2) as in GPT-2."""
        nn.init.normal_(self.w1, std=self.init_std)
        nn.init.normal_(self.w2, std=self.init_std / math.sqrt(2))
        nn.init.normal_(self.router.gate.weight, std=self.init_std)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' weights (a token uses ``top_k / num_experts`` of them; shared experts excluded)."""
        return [self.w1, self.w2]

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x [..., hidden_size]`` to its experts; returns ``(y, aux_loss)`` with ``y`` shaped like ``x``
        (``aux_loss``: this layer's balancing loss and z-loss, or its balance statistics in training under
        ``lbl_scope='model'``; ``token_weights`` shaped ``x.shape[:-1]`` (1 for a token, 0 for padding, as
        Hugging Face's ``attention_mask``) leave padding out of either; every token is still routed)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if self.backend == "triton":
            ops.check_triton_input(tokens)
        jitter = self.router.jitter_eps
        if self.jitter_experts and self.training and jitter > 0:
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - jitter, 1.0 + jitter)
            routing = self.router(tokens, jitter=False)
        else:
            routing = self.router(tokens)
        weights = self._apply_capacity(routing)
        if self.training and self.load_balancing == "aux_free":
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(routing.expert_ids, self.num_experts)
        if self.expert_group is not None and _group_size(self.expert_group) > 1:
            from smalti.moe.expert_parallel import expert_parallel_forward

            y = expert_parallel_forward(self, tokens, routing.expert_ids, weights)
        else:
            y = self.experts_forward(tokens, routing.expert_ids, weights, self.w1, self.w2)
        if self.shared is not None:
            y = y + self.shared(tokens)
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)
        return y.reshape(shape), self.aux_loss(routing, token_weights)

    def experts_forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Dropless expert computation for ``tokens`` routed to ``expert_ids`` (local ids into ``w1``/``w2``).

        ScatterMoE's dataflow: sort only the ids; the first GEMM reads token rows through the permutation
        (sorted output), the second writes its rows back in (token, slot) order, and each token's k rows
        are combined with its weights by a small batched matmul: no gathered copy of ``tokens``, no atomics.
        """
        perm, _counts, offsets = ops.sort_by_expert(expert_ids, w1.shape[0], self.backend)
        h = ops.gather_mm(tokens, w1, perm, offsets, expert_ids.shape[1], self.backend)
        if self.mlp_type == "glu":
            z = ops.glu_mm_scatter(h, w2, perm, offsets, self.activation, self.backend)
        else:
            z = ops.mm_scatter(ACTIVATIONS[self.activation](h), w2, perm, offsets, self.backend)
        return ops.combine(z, weights)

    def _apply_capacity(self, routing: Routing) -> torch.Tensor:
        """Zero the weights of entries past an expert's capacity (later tokens first); dropless returns them as is."""
        if not self.capacity_factor:
            return routing.weights
        tokens, k = routing.expert_ids.shape
        capacity = int(self.capacity_factor * k * tokens / self.num_experts)
        flat = routing.expert_ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = expert_counts(flat, self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        rank = torch.empty_like(rank_sorted)
        rank[order] = rank_sorted
        keep = (rank < capacity).view(tokens, k)
        return routing.weights * keep.to(routing.weights.dtype)

    def aux_loss(self, routing: Routing, token_weights: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's balancing loss (when ``load_balancing='aux_loss'``) plus its router z-loss; under
        ``lbl_scope='model'`` its balance statistics instead (zero outside training); either way each token is
        weighted by ``token_weights`` when given (0 leaves padding out)."""
        loss = routing.logits.new_zeros(())
        self.last_losses = {}
        if self.lbl_scope == "model":
            if self.training and self.load_balancing == "aux_loss" and self.lbl_weight:
                return balance_statistics(routing.probs, routing.expert_ids, self.num_experts, token_weights)
            return loss
        if self.training and self.load_balancing == "aux_loss" and self.lbl_weight:
            lbl = load_balancing_loss(routing.probs, routing.expert_ids, self.num_experts, self.lbl_weight,
                                      self.num_layers, token_weights)
            self.last_losses["load_balancing_loss"] = lbl.detach()
            loss = loss + lbl
        if self.training and self.zloss_weight:
            zloss = router_z_loss(routing.logits, self.zloss_weight, token_weights)
            self.last_losses["router_z_loss"] = zloss.detach()
            loss = loss + zloss
        return loss

    # ------------------------------------------------------------------ aux-free balancing

    @torch.no_grad()
    def update_expert_bias(self, coeff: float = 1e-3, counts: torch.Tensor | None = None) -> None:
        """DeepSeek-V3 balancing: ``b += coeff * sign(mean(n) - n)``, centred; ``n`` = counts since the last update."""
        if self.router.expert_bias is None:
            return
        n = self.tokens_per_expert if counts is None else counts
        delta = coeff * torch.sign(n.float().mean() - n.float())
        self.router.expert_bias += delta - delta.mean()
        self.tokens_per_expert.zero_()


class SharedExpert(nn.Module):
    """An expert every token uses: ``down(act(gate_proj(x)) * up(x))`` (``glu``) or ``down(act(up(x)))``
    (``mlp``), times ``sigmoid(gate(x))`` per token when ``gated`` (Qwen2-MoE's ``shared_expert_gate``)."""

    def __init__(self, hidden_size: int, width: int, mlp_type: str, activation: str, gated: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        factory = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, width, **factory) if mlp_type == "glu" else None
        self.up_proj = nn.Linear(hidden_size, width, **factory)
        self.down_proj = nn.Linear(width, hidden_size, **factory)
        self.gate = nn.Linear(hidden_size, 1, **factory) if gated else None
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output for tokens ``x [T, hidden_size]``."""
        act = ACTIVATIONS[self.activation]
        h = act(self.gate_proj(x)) * self.up_proj(x) if self.gate_proj is not None else act(self.up_proj(x))
        y = self.down_proj(h)
        return y * torch.sigmoid(self.gate(x)) if self.gate is not None else y


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.name](x)


def _resolve_group(group: Any, mesh_dim: str) -> Any:
    """A process group from ``group``: ``None``, a process group, or a ``DeviceMesh`` (its ``mesh_dim``)."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if mesh_dim in names:
            return group.get_group(mesh_dim)
        if group.ndim == 1:
            return group.get_group()
        raise MoEError(f"expert_group is a {group.ndim}-D DeviceMesh with dims {names} and none is named "
                       f"ep_mesh_dim={mesh_dim!r}; name the expert dimension or pass ep_mesh_dim")
    return group


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def dense_ffn_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, mlp_type: str, activation: str,
                        ffn_hidden_size: int) -> torch.Tensor:
    """The dense FFN one expert computes (for tests and benchmarks)."""
    h = x @ w1
    if mlp_type == "glu":
        gate, up = h.split(ffn_hidden_size, dim=-1)
        h = ACTIVATIONS[activation](gate) * up
    else:
        h = ACTIVATIONS[activation](h)
    return h @ w2


__all__ = ["MoE", "SharedExpert", "dense_ffn_reference"]
