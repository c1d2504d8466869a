"""``torch.save``'s bytes for a plain CPU tensor, at a fraction of ``torch.save``'s cost per call.

DCP stores every tensor entry as a ``torch.save`` archive of its own (its reader ``torch.load``s each one), and
``torch.save`` spends ~0.2-1 ms of Python per call on pickling machinery whatever the tensor's size: the cost of
a checkpoint of many small tensors (LoRA adapters with their AdamW state). The archive of a plain tensor is a
function of its layout (dtype, shape, strides, storage size, ...) and its data only, so :func:`save_tensor`
learns each layout's records once from a real ``torch.save`` and writes later tensors of that layout with
torch's own zip writer (``PyTorchFileWriter``): the same records in the same order, the tensor's storage as the
data record. A layout is used only after its replay was checked to be byte-identical to ``torch.save``'s
archive of the same tensor; anything else (a subclass, a tensor with Python state or hooks, a layout whose
replay differed) goes through ``torch.save`` itself.
"""

from __future__ import annotations

import io
import sys
import threading
from typing import Any

import torch

from smalti.checkpoint._compat import PyTorchFileReader, PyTorchFileWriter, get_tensor_metadata

#: records ``PyTorchFileWriter.write_end_of_file`` adds itself
_END_RECORDS = ("version", ".data/serialization_id")
#: the storage's record in the archive of a single tensor
_DATA_RECORD = "data/0"
#: layouts learned, at most this many (a checkpoint has few distinct ones; a new process starts empty)
_MAX_LAYOUTS = 4096

# layout key -> [(record name, bytes, or None for the tensor's storage)], or None: use torch.save for it
_templates: dict[tuple[Any, ...], list[tuple[str, bytes | None]] | None] = {}
_lock = threading.Lock()


def _save_settings() -> tuple[bool, int]:
    """The zip CRC switch and storage alignment ``torch.save`` would use now (they change the archive)."""
    from torch.utils.serialization import config

    return bool(config.save.compute_crc32), int(config.save.storage_alignment)


def _layout_key(tensor: torch.Tensor, settings: tuple[bool, int]) -> tuple[Any, ...] | None:
    """What ``torch.save``'s archive of ``tensor`` depends on besides its data; ``None`` when the tensor is
    not a plain CPU tensor (those always go through ``torch.save``)."""
    if (type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.requires_grad or tensor._backward_hooks or tensor.__dict__):
        return None
    metadata = get_tensor_metadata(tensor)
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
            tensor.untyped_storage().nbytes(), tensor.is_conj(), tensor.is_neg(),
            tuple(sorted(metadata.items())) if metadata else (), settings, sys.byteorder)


def _replay(template: list[tuple[str, bytes | None]], tensor: torch.Tensor, file: Any,
            settings: tuple[bool, int]) -> None:
    writer = PyTorchFileWriter(file, *settings)
    for name, payload in template:
        if payload is None:
            storage = tensor.untyped_storage()
            writer.write_record(name, storage, storage.nbytes())
        else:
            writer.write_record(name, payload, len(payload))
    writer.write_end_of_file()


def _learn(tensor: torch.Tensor, settings: tuple[bool, int]) -> list[tuple[str, bytes | None]] | None:
    """The records of ``tensor``'s layout, from ``torch.save``'s archive of it; ``None`` when replaying them
    does not give back exactly that archive."""
    saved = io.BytesIO()
    torch.save(tensor, saved)
    reader = PyTorchFileReader(io.BytesIO(saved.getvalue()))
    names = [name for name in reader.get_all_records() if name not in _END_RECORDS]
    if [name for name in names if name.startswith("data/")] != [_DATA_RECORD]:
        return None
    template = [(name, None if name == _DATA_RECORD else bytes(reader.get_record(name))) for name in names]
    replayed = io.BytesIO()
    try:
        _replay(template, tensor, replayed, settings)
    except (RuntimeError, TypeError, ValueError):
        return None
    return template if replayed.getvalue() == saved.getvalue() else None


def save_tensor(tensor: torch.Tensor, file: Any) -> None:
    """Write to ``file`` (a writable binary file object) exactly the bytes ``torch.save(tensor, file)`` writes
    under the current ``torch.utils.serialization.config.save`` settings."""
    settings = _save_settings()
    key = _layout_key(tensor, settings)
    if key is None:
        torch.save(tensor, file)
        return
    with _lock:
        known = key in _templates
        template = _templates.get(key)
    if not known:
        template = _learn(tensor, settings)
        with _lock:
            if len(_templates) >= _MAX_LAYOUTS:
                _templates.clear()
            _templates[key] = template
    if template is None:
        torch.save(tensor, file)
        return
    _replay(template, tensor, file, settings)
    file.flush()
