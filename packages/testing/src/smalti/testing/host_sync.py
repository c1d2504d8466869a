"""Count the calls that would make the host wait for the GPU, on any device (a CPU is enough).

On a GPU, Python only queues kernels; the host waits (a pipeline stall) whenever it needs a value or a shape
that a kernel computes. :func:`count_host_syncs` records every such call made inside its block, treating
every tensor as if it lived on a GPU:

* reading a value on the host: ``Tensor.item``, ``float()``/``int()``/``bool()``/``index()`` of a tensor,
  ``tolist``, ``numpy``, printing or formatting a tensor;
* copying to the host: ``.cpu()``, ``.to("cpu")`` (or to a CPU device), ``.numpy()``;
* ops whose output shape depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ...) and ops that return a Python
  value computed from the data (``equal``, ``is_nonzero``): found by the ``dynamic_output_shape`` and
  ``data_dependent_output`` tags PyTorch puts on its operators.

Calls made while Triton's CPU interpreter runs a kernel are not counted: on a GPU the kernel launch copies
nothing to the host. A call inside another counted call counts once (``float(t)`` is one sync, not two).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__index__: "index",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.__repr__: "repr",
    torch.Tensor.__str__: "str",
    torch.Tensor.__format__: "format",
    torch.Tensor.__array__: "array",
}
_SYNC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


@dataclass
class HostSync:
    """One counted call: what it was and where in the caller's code it happened."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


@dataclass
class HostSyncCounter:
    """The calls recorded by :func:`count_host_syncs`, in order."""

    syncs: list[HostSync] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.syncs)

    def report(self) -> str:
        """One line per recorded call, for assertion messages."""
        return "\n".join(str(s) for s in self.syncs) or "(none)"

    def clear(self) -> None:
        self.syncs.clear()


def _caller() -> str:
    """The innermost frame outside torch and this module: where the user's code asked for the value."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-2]):
        name = frame.filename
        if "/torch/" in name or name == __file__ or "/contextlib.py" in name:
            continue
        return f"{name}:{frame.lineno} ({frame.name})"
    return "?"


def _in_triton_interpreter() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "/triton/runtime/interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _is_cpu_target(args: tuple, kwargs: dict) -> bool:
    targets = [kwargs.get("device"), *args[1:2]]
    for target in targets:
        if isinstance(target, str) and target.split(":")[0] == "cpu":
            return True
        if isinstance(target, torch.device) and target.type == "cpu":
            return True
    return False


class _Modes:
    def __init__(self, counter: HostSyncCounter) -> None:
        self.counter = counter
        self.depth = 0  # inside a counted call: what it does underneath is part of it

    def record(self, op: str) -> None:
        if self.depth == 0 and not _in_triton_interpreter():
            self.counter.syncs.append(HostSync(op, _caller()))


class _FunctionMode(TorchFunctionMode):
    def __init__(self, modes: _Modes) -> None:
        super().__init__()
        self.modes = modes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = _READS.get(func)
        if op is None and func is torch.Tensor.to and _is_cpu_target(args, kwargs):
            op = "to(cpu)"
        if op is None:
            return func(*args, **kwargs)
        self.modes.record(op)
        self.modes.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.modes.depth -= 1


class _DispatchMode(TorchDispatchMode):
    def __init__(self, modes: _Modes) -> None:
        super().__init__()
        self.modes = modes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tags = getattr(func, "tags", ())
        if any(tag in tags for tag in _SYNC_TAGS) and not _has_static_size(func, args, kwargs):
            self.modes.record(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _has_static_size(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Ops tagged as data-dependent that are not when told their output size."""
    name = func.overloadpacket.__name__
    if name == "repeat_interleave":
        return (kwargs or {}).get("output_size") is not None
    if name == "nonzero_static":
        return True
    if name in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        # Integer indices give a known shape; only a boolean mask makes it depend on the data.
        indices = args[1] if len(args) > 1 else (kwargs or {}).get("indices", ())
        return not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


@contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """Record, inside the block, every call that would force a device-to-host sync on a GPU.

    Usage::

        with count_host_syncs() as syncs:
            trainer.train_step(batch)
        assert syncs.count == 0, syncs.report()
    """
    counter = HostSyncCounter()
    modes = _Modes(counter)
    with _FunctionMode(modes), _DispatchMode(modes):
        yield counter


__all__ = ["HostSync", "HostSyncCounter", "count_host_syncs"]
