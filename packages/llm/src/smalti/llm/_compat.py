"""Every private torch name smalti-llm uses, resolved once at import.

Other modules import these from here, never from torch's private modules, so a torch upgrade that moves one
fails when the module is imported (:class:`~smalti.core.errors.UnsupportedVersionError` naming the torch
version), not mid-run. ``PRIVATE_NAMES`` lists them for the test that checks each one.
"""

from __future__ import annotations

from typing import Any

from smalti.core.versions import private_name

#: The shape and global offset of this rank's shard of a DTensor (writing imported weights into FSDP2 shards).
compute_local_shape_and_global_offset = private_name(
    "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
#: Gamma(alpha, 1) samples drawn with a given ``torch.Generator`` (the public ``torch.distributions.Gamma``
#: takes no generator; the synthetic corpus must be the same for a seed on every rank).
standard_gamma = private_name("torch", "_standard_gamma")

PRIVATE_NAMES: dict[str, Any] = {
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": compute_local_shape_and_global_offset,
    "torch._standard_gamma": standard_gamma,
}
