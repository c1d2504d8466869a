"""``save_tensor`` writes exactly ``torch.save``'s bytes, and pays ``torch.save``'s per-call cost once per layout."""

import io

import pytest
import torch
from torch.utils.serialization import config

from smalti.checkpoint import tensor_records
from smalti.checkpoint.tensor_records import save_tensor


def torch_saved(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def ours(tensor):
    buffer = io.BytesIO()
    save_tensor(tensor, buffer)
    return buffer.getvalue()


def cases():
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    return {
        "fp32": torch.randn(16, 8), "bf16": torch.randn(3, 7).bfloat16(), "int64 scalar": torch.tensor(12),
        "step": torch.tensor(3.0), "empty": torch.zeros(0, 4), "transposed": base.t(), "view at an offset": base[2:],
        "bool": torch.rand(9) > 0.5, "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn), "complex": torch.randn(3, 2, dtype=torch.complex64),
        "parameter": torch.nn.Parameter(torch.randn(4)), "requires grad": torch.randn(3, requires_grad=True),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
    }


@pytest.mark.parametrize("crc", [False, True], ids=["no-crc", "crc"])
def test_the_bytes_are_torch_saves_and_load_back(crc):
    before = config.save.compute_crc32
    config.save.compute_crc32 = crc
    try:
        for name, tensor in cases().items():
            for _ in range(2):  # learning the layout, then replaying it
                data = ours(tensor)
                assert data == torch_saved(tensor), name
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            assert torch.equal(loaded, tensor.detach()) and loaded.dtype == tensor.dtype, name
    finally:
        config.save.compute_crc32 = before


def test_torch_save_runs_once_per_layout(monkeypatch):
    """500 tensors of two layouts: torch.save learns each layout once; the others are replayed."""
    calls = []
    real = torch.save

    def spy(obj, f, *args, **kwargs):
        calls.append(type(obj))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    tensor_records._templates.clear()
    torch.manual_seed(0)
    tensors = [torch.randn(31, 17) for _ in range(250)] + [torch.tensor(float(i)) for i in range(250)]
    for tensor in tensors:
        saved = ours(tensor)
        assert torch.equal(torch.load(io.BytesIO(saved), weights_only=True), tensor)
    assert len(calls) == 2, f"torch.save ran {len(calls)} times for 500 tensors of 2 layouts"
    # a subclass (its archive names its type) always goes through torch.save
    ours(torch.nn.Parameter(torch.randn(31, 17)))
    assert len(calls) == 3


def test_a_layout_whose_replay_differs_falls_back_to_torch_save(monkeypatch):
    tensor_records._templates.clear()
    real = tensor_records._replay

    def wrong(template, tensor, file, settings):
        return real(template[1:], tensor, file, settings)  # drops a record: not torch.save's archive

    monkeypatch.setattr(tensor_records, "_replay", wrong)
    tensor = torch.randn(5, 3)
    assert ours(tensor) == torch_saved(tensor)
    assert ours(tensor) == torch_saved(tensor)
