"""Where a rank sits: its node, its data-parallel rank and the columns of every global batch it reads."""

from __future__ import annotations

import os
from dataclasses import dataclass

from smalti.streaming.errors import StreamingError


def world_from_env() -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, local world size)`` from the process group or torchrun's environment."""
    import torch.distributed as dist

    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    return rank, world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))


@dataclass(frozen=True)
class RankLayout:
    """One rank of a job: ranks are numbered node by node (``local_world`` per node, sharing the node's cache),
    ``replication`` consecutive ranks read the same samples, and each data-parallel rank reads ``batch_size``
    consecutive columns of every global batch."""

    rank: int
    world_size: int
    local_world: int
    replication: int
    batch_size: int

    @classmethod
    def resolve(cls, rank: int | None, world_size: int | None, local_world_size: int | None,
                replication: int | None, batch_size: int | None) -> RankLayout:
        """The layout from the arguments given, the rest from the process group or torchrun's environment;
        a layout that cannot be is refused, naming the argument at fault."""
        env_rank, env_world, _, env_local_world = world_from_env()
        explicit = rank is not None or world_size is not None
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise StreamingError(f"rank={rank} is not in a world of {world_size}")
        if local_world_size is None:
            local_world_size = env_local_world
            if explicit and (world_size % local_world_size or local_world_size > world_size):
                local_world_size = 1  # the environment describes another world than the one given here
        if local_world_size < 1 or world_size % local_world_size:
            raise StreamingError(f"local_world_size={local_world_size} (ranks per node) must divide the world "
                                 f"size {world_size}")
        replication = replication or 1
        if world_size % replication:
            raise StreamingError(f"replication={replication} must divide the world size {world_size}")
        if batch_size is not None and batch_size < 1:
            raise StreamingError(f"batch_size={batch_size} must be a positive number of samples per rank")
        return cls(rank, world_size, local_world_size, replication, batch_size or 1)

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world

    @property
    def physical_nodes(self) -> int:
        return self.world_size // self.local_world

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks (replicas counted once)."""
        return self.world_size // self.replication

    @property
    def dp_rank(self) -> int:
        return self.rank // self.replication

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_world

    def rank_columns(self) -> tuple[int, int]:
        """The columns ``[lo, hi)`` of every global batch this rank reads."""
        return self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size

    def node_columns(self) -> tuple[int, int]:
        """The columns ``[lo, hi)`` of every global batch that the ranks of this rank's physical node read."""
        b = self.batch_size
        first_rank = self.rank // self.local_world * self.local_world
        lo = first_rank // self.replication
        hi = (first_rank + self.local_world - 1) // self.replication + 1
        return lo * b, hi * b
