"""A data loader that keeps its own position (``state_dict``/``load_state_dict``), as streaming loaders do."""

import torch


class PositionLoader:
    """Yields ``n`` fixed regression batches and remembers how many it has yielded this epoch."""

    def __init__(self, n: int = 8, batch_size: int = 16, seed: int = 5) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.batches = [(torch.randn(batch_size, 16, generator=gen), torch.randn(batch_size, 4, generator=gen))
                        for _ in range(n)]
        self.batch_size = batch_size
        self.position = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, saved: dict) -> None:
        self.position = saved["position"]
