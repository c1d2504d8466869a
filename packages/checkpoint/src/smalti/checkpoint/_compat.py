"""Every private torch name smalti-checkpoint uses, resolved once at import.

Other modules import these from here, never from torch's private modules, so a torch upgrade that moves one
fails when the checkpoint code is imported (:class:`~smalti.core.errors.UnsupportedVersionError` naming the
torch version), not in the middle of a save or a load. ``PRIVATE_NAMES`` lists them for the test that checks
each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from smalti.core.versions import private_name


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The block of ``tensor`` starting at ``offsets`` with ``sizes`` (a view; what DCP's helper does)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if offset != 0 or size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


#: A view of a tensor's block at given offsets and sizes (the local fallback has the same semantics).
narrow_tensor_by_index = private_name("torch.distributed._shard._utils", "narrow_tensor_by_index", fallback=_narrow)
#: Sets a value in a nested state dict at a path DCP's flattening recorded (loading non-tensor entries).
set_element = private_name("torch.distributed.checkpoint._traverse", "set_element")
#: A module parameter's fully qualified names as DCP's state dict names them (matching optimizer state).
get_fqns = private_name("torch.distributed.checkpoint.state_dict", "_get_fqns")
#: Host buffers shaped like a state dict (pinned when CUDA is present), reused across saves.
create_cpu_state_dict = private_name("torch.distributed._state_dict_utils", "_create_cpu_state_dict")
#: torch's weights-only unpickler (reading a saved tensor's header without its data).
weights_only_unpickler = private_name("torch._weights_only_unpickler")
#: The zip reader behind ``torch.load`` (locating a saved tensor's bytes inside a DCP data file).
PyTorchFileReader = private_name("torch._C", "PyTorchFileReader")
#: How a ``torch.layout`` pickles, and DCP metadata's memory-format table and per-item storage record:
#: names a pickle of DCP's ``.metadata`` may refer to (the restricted unpickler allows exactly these).
get_layout = private_name("torch.serialization", "_get_layout")
MEM_FORMAT_ENCODING = private_name("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
StorageInfo = private_name("torch.distributed.checkpoint.filesystem", "_StorageInfo")
#: The zip writer behind ``torch.save`` (writing a saved tensor's records without torch.save's per-call cost).
PyTorchFileWriter = private_name("torch._C", "PyTorchFileWriter")
#: The extra tensor state ``torch.save`` pickles beside shape and strides (part of a saved tensor's layout).
get_tensor_metadata = private_name("torch._utils", "get_tensor_metadata")
#: How DCP's file writer shares a rank's entries among its files (one per writer thread), by type and size.
split_by_size_and_type = private_name("torch.distributed.checkpoint.filesystem", "_split_by_size_and_type")

PRIVATE_NAMES: dict[str, Any] = {
    "torch.distributed._shard._utils.narrow_tensor_by_index": narrow_tensor_by_index,
    "torch.distributed.checkpoint._traverse.set_element": set_element,
    "torch.distributed.checkpoint.state_dict._get_fqns": get_fqns,
    "torch.distributed._state_dict_utils._create_cpu_state_dict": create_cpu_state_dict,
    "torch._weights_only_unpickler": weights_only_unpickler,
    "torch._C.PyTorchFileReader": PyTorchFileReader,
    "torch.serialization._get_layout": get_layout,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": MEM_FORMAT_ENCODING,
    "torch.distributed.checkpoint.filesystem._StorageInfo": StorageInfo,
    "torch._C.PyTorchFileWriter": PyTorchFileWriter,
    "torch._utils.get_tensor_metadata": get_tensor_metadata,
    "torch.distributed.checkpoint.filesystem._split_by_size_and_type": split_by_size_and_type,
}
