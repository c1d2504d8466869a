"""Balancing losses with MegaBlocks' formulas, computed per layer and returned to the caller."""

from __future__ import annotations

import torch


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, slot) entries chose each expert, ``[E]`` int64.

    A scatter-add, not ``bincount``: bincount sizes its output by the largest id, which on a GPU waits for the
    device.
    """
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, weight: float,
                        num_layers: int = 1, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/MegaBlocks load-balancing loss of one layer, in fp32.

    ``weight * E / (L * T * k) * sum_e c_e * mean_t p[t, e]`` where ``c_e`` counts the (token, slot)
    assignments to expert ``e``, ``p`` are the router's probabilities over all experts (not only the
    top-k) and ``L`` is the model's number of MoE layers: summed over the layers this is MegaBlocks'
    ``batched_load_balancing_loss``. Equals ``weight / L`` when routing is perfectly balanced.
    ``token_weights [T]`` (0 for padding) weight each token in ``T``, ``c_e`` and the mean, as
    :func:`balance_statistics` does, so padding does not weigh on the balance.
    """
    k = expert_ids.shape[1]
    stats = balance_statistics(probs, expert_ids, num_experts, token_weights)
    counts, prob_sums, tokens = stats[:num_experts], stats[num_experts:2 * num_experts], stats[-1]
    return weight * num_experts / (num_layers * tokens * k) * torch.dot(counts, prob_sums / tokens)


def balance_statistics(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                       token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's routing statistics for :func:`pooled_load_balancing_loss`, ``[2 E + 1]`` fp32: the (token,
    slot) count per expert, the sum over tokens of each expert's probability (carrying the router's gradient),
    and the token count. ``token_weights [T]`` (1 counts a token, 0 leaves it out: Hugging Face's
    ``attention_mask``, so padding does not weigh on the balance) weights each token in all three."""
    if token_weights is None:
        counts = expert_counts(expert_ids, num_experts).float()
        rows = probs.new_full((1,), expert_ids.shape[0], dtype=torch.float32)
        return torch.cat([counts, probs.float().sum(0), rows])
    w = token_weights.reshape(-1).float()
    if w.numel() != expert_ids.shape[0]:
        raise ValueError(f"token_weights has {w.numel()} entries for {expert_ids.shape[0]} tokens")
    counts = torch.zeros(num_experts, dtype=torch.float32, device=w.device).scatter_add_(
        0, expert_ids.reshape(-1), w.repeat_interleave(expert_ids.shape[1]))
    return torch.cat([counts, (probs.float() * w[:, None]).sum(0), w.sum().reshape(1)])


def pooled_load_balancing_loss(statistics: torch.Tensor, num_experts: int, weight: float) -> torch.Tensor:
    """Hugging Face's ``load_balancing_loss_func`` times ``weight`` (``router_aux_loss_coef``), from the sum over
    layers of :func:`balance_statistics`: ``weight * E * sum_e f_e P_e`` where ``f_e`` is the share of (token,
    slot) entries and ``P_e`` the mean probability of expert ``e``, both pooled over every layer's tokens before
    the product (so it is not a sum of per-layer losses). Equals ``weight * k`` when routing is balanced.
    """
    counts, prob_sums, rows = statistics[:num_experts], statistics[num_experts:2 * num_experts], statistics[-1]
    return weight * num_experts * torch.dot(counts / rows, prob_sums / rows)


def router_z_loss(logits: torch.Tensor, weight: float, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: ``weight * mean_t logsumexp(logits[t])^2`` (ST-MoE), in fp32; the mean weighted by
    ``token_weights [T]`` when given (0 leaves a padding token out)."""
    z = torch.logsumexp(logits.float(), dim=-1).pow(2)
    if token_weights is None:
        return weight * z.mean()
    w = token_weights.reshape(-1).float()
    return weight * (z * w).sum() / w.sum()
