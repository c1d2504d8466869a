"""Top-k token-choice router: softmax or sigmoid scores, jitter, renormalisation, optional balancing bias."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from smalti.moe.errors import MoEError


@dataclass
class Routing:
    """What the router decided for ``T`` tokens: ``weights [T, k]``, ``expert_ids [T, k]``, and for the losses
    the raw ``logits [T, E]`` and the probabilities ``probs [T, E]`` over all experts."""

    weights: torch.Tensor
    expert_ids: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    """Scores every expert for each token and keeps the top ``k``.

    ``score_func``: ``softmax`` or ``sigmoid``. ``jitter_eps`` multiplies the input by U(1-eps, 1+eps) in
    training. ``normalize_expert_weights``: p-norm of the kept weights (1 = they sum to one; None = raw).
    With a ``bias`` (aux-loss-free balancing) experts are *selected* by score + bias, but weighted by the
    unbiased score, as DeepSeek-V3 does.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 jitter_eps: float = 0.0, normalize_expert_weights: float | None = None, use_bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise MoEError(f"score_func={score_func!r} must be 'softmax' or 'sigmoid'")
        if not 1 <= top_k <= num_experts:
            raise MoEError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.jitter_eps = score_func, jitter_eps
        self.normalize_expert_weights = normalize_expert_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if use_bias else None, persistent=use_bias)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Gate logits in at least fp32 (as torchtitan does), also under autocast: routing decisions and
        the losses must not depend on bf16 rounding."""
        weight = self.gate.weight
        if x.dtype == torch.float64 and weight.dtype == torch.float64:
            return F.linear(x, weight)
        off = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else nullcontext()
        with off:
            return F.linear(x.float(), weight.float())

    def forward(self, x: torch.Tensor, jitter: bool = True) -> Routing:
        """Scores, top-k choice and weights for ``x [T, hidden_size]``; ``jitter=False`` when the caller has
        already jittered ``x`` (for the experts too, as Mixtral does)."""
        if jitter and self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        logits = self._logits(x)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        select = scores if self.expert_bias is None else scores + self.expert_bias
        expert_ids = select.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.normalize_expert_weights is not None:
            weights = weights / weights.norm(p=self.normalize_expert_weights, dim=-1, keepdim=True).clamp_min(1e-20)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(weights=weights.to(x.dtype), expert_ids=expert_ids, logits=logits, probs=probs)
