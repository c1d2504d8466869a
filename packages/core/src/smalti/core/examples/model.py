"""Example models following smalti's model protocol (forward, loss, metrics, flops_per_batch)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smalti.core.config.types import PositiveInt, ProperFraction

# torchmetrics (which imports scipy.signal and, when installed, transformers: seconds per process) is imported
# only where a metric is built or checked, not at import: training without evaluation never needs it.


def __getattr__(name: str) -> Any:
    if name in ("LanguageCrossEntropy", "TokenAccuracy"):
        from smalti.core.examples import metrics

        return getattr(metrics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class MLPRegressor(nn.Module):
    """A small MLP for ``(x, y)`` regression batches, with MSE loss.

    ``dropout`` (default 0) adds dropout after each hidden layer; it draws from torch's global generator,
    which checkpoints save and restore, so runs with it resume bit-identically too.
    """

    def __init__(self, in_features: PositiveInt = 16, hidden: PositiveInt = 64, out_features: PositiveInt = 4, depth: PositiveInt = 2,
                 dropout: ProperFraction = 0.0) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.GELU(), *([nn.Dropout(dropout)] if dropout else []))
            for a, b in zip(dims, dims[1:])
        )
        self.head = nn.Linear(dims[-1], out_features)

    def init_weights(self) -> None:
        """Fill the parameters in place with torch's default ``Linear`` init (for a model built on meta)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(outputs.float(), batch[1])

    def metrics(self, train: bool = False) -> dict[str, Any]:
        from torchmetrics import MeanSquaredError

        return {"MSE": MeanSquaredError()}

    def flops_per_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        params = sum(p.numel() for p in self.parameters())
        return 6.0 * params * batch[0].shape[0]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A byte-level causal transformer. Batches are ``{"input_ids": LongTensor[B, T + 1]}``."""

    def __init__(self, vocab_size: PositiveInt = 256, d_model: PositiveInt = 128, n_heads: PositiveInt = 4, n_layers: PositiveInt = 2,
                 max_seq_len: PositiveInt = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.n_layers, self.d_model = n_layers, d_model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"][:, :-1]
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        targets = batch["input_ids"][:, 1:]
        return F.cross_entropy(outputs.float().reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    def metrics(self, train: bool = False) -> dict[str, Any]:
        from smalti.core.examples.metrics import LanguageCrossEntropy, TokenAccuracy

        return {"CrossEntropy": LanguageCrossEntropy(), "Accuracy": TokenAccuracy()}

    def update_metric(self, batch: dict[str, torch.Tensor], outputs: torch.Tensor, metric: Any) -> None:
        from smalti.core.examples.metrics import TokenAccuracy

        targets = batch["input_ids"][:, 1:]
        if isinstance(metric, TokenAccuracy):
            metric.update((outputs.argmax(-1) == targets).float().mean(), weight=targets.numel())
        else:
            metric.update(self.loss(outputs, batch), weight=targets.numel())

    def num_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        ids = batch["input_ids"]
        return ids.shape[0] * (ids.shape[1] - 1)

    def flops_per_batch(self, batch: dict[str, torch.Tensor]) -> float:
        tokens = self.num_tokens(batch)
        seq = batch["input_ids"].shape[1] - 1
        params = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("pos"))
        attention = 12 * self.n_layers * self.d_model * seq  # per token, fwd+bwd, as LLM Foundry counts it
        return (6.0 * params + attention) * tokens
